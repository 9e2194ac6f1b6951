"""Block-sparse paged decode attention in XLA: the fast path on CPU.

Gathers only the kept pages, so its cost follows the kept width K (static, the table width)
rather than the context. Multiply-and-reduce instead of matrix products: with one query per
sequence the products are tiny and XLA fuses the page gather into the reductions. Accumulates
in float32. A selection shared by the KV heads gathers whole pages ([KVH, ps, hd], contiguous in
the pool); a per-head selection gathers one [ps, hd] tile per (page, head).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.block_sparse.validation import check_inputs


def block_sparse_attention_xla(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    kept_blocks: jax.Array,
    kept_counts: jax.Array,
    lengths: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """See the package docstring."""
    check_inputs(q, k_pages, v_pages, page_table, kept_blocks, kept_counts, lengths)
    b, h, hd = q.shape
    _, kvh, ps, _ = k_pages.shape
    k = kept_blocks.shape[-1]
    physical = jnp.take_along_axis(page_table[:, None, :], kept_blocks, axis=2)  # [B, 1|KVH, K]
    if kept_blocks.shape[1] == 1:
        keys = k_pages[physical[:, 0]].transpose(0, 2, 1, 3, 4)  # [B, KVH, K, ps, hd]
        values = v_pages[physical[:, 0]].transpose(0, 2, 1, 3, 4)
    else:
        heads = jnp.arange(kvh)[None, :, None]
        keys = k_pages[physical, heads]  # [B, KVH, K, ps, hd]
        values = v_pages[physical, heads]
    positions = kept_blocks[..., None] * ps + jnp.arange(ps)  # [B, 1|KVH, K, ps]
    valid = (positions < lengths[:, None, None, None]) & (
        jnp.arange(k)[None, None, :, None] < kept_counts[..., None, None]
    )
    qg = q.reshape(b, kvh, h // kvh, 1, 1, hd).astype(jnp.float32)
    scores = jnp.sum(qg * keys[:, :, None].astype(jnp.float32), axis=-1) * hd**-0.5
    scores = jnp.where(valid[:, :, None], scores, -jnp.inf)  # [B, KVH, G, K, ps]
    peak = jnp.max(scores, axis=(3, 4), keepdims=True)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    weights = jnp.exp(scores - peak)
    total = jnp.sum(weights, axis=(3, 4), keepdims=True)
    probs = weights / jnp.where(total > 0, total, 1.0)
    out = jnp.sum(probs[..., None] * values[:, :, None].astype(jnp.float32), axis=(3, 4))
    block_mass = probs.sum(axis=-1).mean(axis=2)
    return out.reshape(b, h, hd).astype(q.dtype), block_mass
