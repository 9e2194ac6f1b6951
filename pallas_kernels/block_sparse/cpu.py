"""Block-sparse decode attention on the C++ kernel (cpp_kernels/block_sparse.cc, an XLA FFI
call), the `cpu` attention backend's pruned steps: each (row, KV head) reads its kept pages
where they lie (same signature and results as the other backends, the package docstring)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from cpp_kernels import call_cpu_kernel
from cpp_kernels.targets import BLOCK_SPARSE
from pallas_kernels.block_sparse.validation import check_inputs


def block_sparse_attention_cpu(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    kept_blocks: jax.Array,
    kept_counts: jax.Array,
    lengths: jax.Array,
    leaders: jax.Array | None = None,
    shared_counts: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """See the package docstring. leaders, shared_counts [B] int32 (optional): rows sharing a
    prefix, computed together: row b with the row leaders[b] (a row leading itself), whose
    first shared_counts[leader] kept entries are the same pages for every row of its group
    and are read once for all of them (cpp_kernels/block_sparse.cc). The results are
    those of the rows computed apart; None: every row alone."""
    check_inputs(q, k_pages, v_pages, page_table, kept_blocks, kept_counts, lengths)
    b, h, hd = q.shape
    if leaders is None:
        leaders = jnp.arange(b, dtype=jnp.int32)
    if shared_counts is None:
        shared_counts = jnp.zeros((b,), jnp.int32)
    kvh = k_pages.shape[1]
    out, mass = call_cpu_kernel(
        BLOCK_SPARSE,
        (
            jax.ShapeDtypeStruct((b, h, hd), jnp.float32),
            jax.ShapeDtypeStruct((b, kvh, kept_blocks.shape[-1]), jnp.float32),
        ),
        q.astype(jnp.float32),
        k_pages,
        v_pages,
        page_table,
        kept_blocks,
        kept_counts,
        lengths,
        leaders.astype(jnp.int32),
        shared_counts.astype(jnp.int32),
        scale=np.float32(hd**-0.5),
    )
    return out.astype(q.dtype), mass
