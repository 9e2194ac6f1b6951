"""Pruned decode on the CPU kernels (cpp_kernels, XLA FFI calls), the `cpu` attention
backend's pruned steps (etjax/attention/backend.py): `block_sparse_attention_cpu`, where each
(row, KV head) reads its kept pages where they lie (same signature and results as the other
backends, the package docstring), and `page_bounds_cpu`, the pages' Quest bounds the
selection ranks them by, read in place."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from cpp_kernels import call_cpu_kernel
from cpp_kernels.targets import BLOCK_SPARSE, PAGE_BOUNDS, SELECT_BLOCKS
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


def page_bounds_cpu(
    q: jax.Array,
    k_min: jax.Array,
    k_max: jax.Array,
    page_table: jax.Array,
    num_blocks: jax.Array,
    shared: bool,
) -> jax.Array:
    """The Quest bound of each row's pages on the CPU kernel (cpp_kernels/page_bounds.cc):
    q [B, H, hd]; k_min, k_max [N, KVH, hd]; page_table [B, P]; num_blocks [B] the pages
    each row holds. Returns scores [B, 1 if shared else KVH, P] float32: the
    largest scaled q.k each page's key bounds allow (etjax/pruning/block_scores.py's
    `block_upper_bounds`, the maximum over KV heads when shared), -inf past num_blocks."""
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


def select_blocks_cpu(scores, num_blocks, budget, cfg, max_kept: int, last_mass=None):
    """etjax/pruning/selection.py's `select_blocks` on the CPU kernel (cpp_kernels/
    select_blocks.cc): the same arguments and the same kept blocks and counts, ties to the
    lower block as `lax.top_k` breaks them."""
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
        cfg.sink_blocks,
        cfg.recent_blocks,
        jnp.asarray(cfg.mass_threshold, jnp.float32),
        mass.astype(jnp.float32),
        ranks_by_mass=np.int32(last_mass is not None),
        max_kept=np.int32(max_kept),
    )
