"""Block selection on the C++ kernel (cpp_kernels/select_blocks.cc): the rule of xla.py, a
partial sort of the few kept blocks where XLA:CPU's top-k sorts each row's whole table."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from cpp_kernels import call_cpu_kernel
from cpp_kernels.targets import SELECT_BLOCKS


def select_blocks_cpu(
    scores: jax.Array,
    num_blocks: jax.Array,
    budget: jax.Array,
    sink_blocks: jax.Array | int,
    recent_blocks: jax.Array | int,
    mass_threshold: jax.Array | float,
    max_kept: int,
    last_mass: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """`select_blocks_xla` on the CPU kernel: the same arguments and the same kept blocks and
    counts, ties to the lower block as `lax.top_k` breaks them."""
    b, heads, _ = scores.shape
    mass = jnp.zeros((1, 1, 1), jnp.float32) if last_mass is None else last_mass
    return call_cpu_kernel(
        SELECT_BLOCKS,
        (
            jax.ShapeDtypeStruct((b, heads, max_kept), jnp.int32),
            jax.ShapeDtypeStruct((b, heads), jnp.int32),
        ),
        scores.astype(jnp.float32),
        num_blocks,
        budget,
        sink_blocks,
        recent_blocks,
        jnp.asarray(mass_threshold, jnp.float32),
        mass.astype(jnp.float32),
        ranks_by_mass=np.int32(last_mass is not None),
        max_kept=np.int32(max_kept),
    )
