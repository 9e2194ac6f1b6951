"""The dense ragged pass on the CPU kernel (cpp_kernels/ragged_pass.cc, an XLA FFI call that
reads the KV pages in place): decode tiles and prompt chunks alike.

`ragged_pass_cpu` takes the arguments of the XLA backend's passes and returns the same
(outputs, log-sum-exps), so xla.py runs it in place of its loops for the `cpu` attention
backend (etjax/attention/backend.py), which the engine picks on a CPU when
`cpp_kernels.cpu_kernels_available()`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from cpp_kernels import call_cpu_kernel
from cpp_kernels.targets import RAGGED_PASS
from pallas_kernels.ragged_attention.work_items import TilePass


def ragged_pass_cpu(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    q_positions: jax.Array,
    tile_pass: TilePass,
    window: jax.Array | int,
    softcap: float,
) -> tuple[jax.Array, jax.Array]:
    """One pass of ragged attention on the CPU kernel: q [T, H, hd], pools [N, KVH, ps, hd]
    (float32, float16 or bfloat16), q_positions [T], `tile_pass` as work_items.py builds it.
    Returns the tiles' outputs [Nq, Qt, H, hd] and log-sum-exps [Nq, Qt, H], float32."""
    _, h, hd = q.shape
    nq, qt = tile_pass.tile_tokens.shape
    return call_cpu_kernel(
        RAGGED_PASS,
        (
            jax.ShapeDtypeStruct((nq, qt, h, hd), jnp.float32),
            jax.ShapeDtypeStruct((nq, qt, h), jnp.float32),
        ),
        q.astype(jnp.float32),
        k_pages,
        v_pages,
        q_positions,
        *tile_pass,
        jnp.asarray(window, jnp.int32),
        softcap=np.float32(softcap),
        scale=np.float32(hd**-0.5),
    )
