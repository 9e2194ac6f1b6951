"""The pages' Quest bounds on the C++ kernel (cpp_kernels/page_bounds.cc), which reads each
row's own pages' bounds where they lie (the package docstring's signature)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from cpp_kernels import call_cpu_kernel
from cpp_kernels.targets import PAGE_BOUNDS


def page_bounds_cpu(
    q: jax.Array,
    k_min: jax.Array,
    k_max: jax.Array,
    page_table: jax.Array,
    num_blocks: jax.Array,
    shared: bool,
) -> jax.Array:
    """The Quest bound of each row's pages on the CPU kernel: q [B, H, hd]; k_min, k_max
    [N, KVH, hd]; page_table [B, P]; num_blocks [B] the pages each row holds. Returns scores
    [B, 1 if shared else KVH, P] float32: the largest scaled q.k each page's key bounds allow
    (reference.py's `block_upper_bounds`, the maximum over KV heads when shared), -inf past
    num_blocks."""
    b, _, hd = q.shape
    heads = 1 if shared else k_min.shape[1]
    return call_cpu_kernel(
        PAGE_BOUNDS,
        jax.ShapeDtypeStruct((b, heads, page_table.shape[1]), jnp.float32),
        q.astype(jnp.float32),
        k_min.astype(jnp.float32),
        k_max.astype(jnp.float32),
        page_table,
        num_blocks,
        scale=np.float32(hd**-0.5),
        shared=np.int32(shared),
    )
