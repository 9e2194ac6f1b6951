"""The float32 attention reference the kernel tests check against, jitted once for all of them.

Called eagerly, each of the reference's operations compiles a program of its own for every
shape a test draws (hundreds a module); jitted, each shape compiles one program, and modules
of one run that draw the same shapes (tests/test_cpu_kernel.py reuses
tests/test_ragged_attention.py's cases) share it. What it computes is the same function,
float32 throughout.
"""

from __future__ import annotations

import jax

from pallas_kernels.ragged_attention.reference import ragged_attention_reference as _plain

# window and softcap choose Python branches of the reference (`if window:`): static.
ragged_attention_reference = jax.jit(_plain, static_argnames=("window", "softcap"))
