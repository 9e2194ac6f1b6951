"""The float32 reference of block-sparse paged decode attention: plain, obviously right."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.block_sparse.validation import check_inputs, per_head


def block_sparse_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    kept_blocks: jax.Array,
    kept_counts: jax.Array,
    lengths: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """See the package docstring. Computes in float32; returns out in q's dtype."""
    check_inputs(q, k_pages, v_pages, page_table, kept_blocks, kept_counts, lengths)
    kept_blocks, kept_counts = per_head(kept_blocks, kept_counts, k_pages.shape[1])
    b, h, hd = q.shape
    _, kvh, ps, _ = k_pages.shape
    k = kept_blocks.shape[-1]
    group = h // kvh
    physical = jnp.take_along_axis(page_table[:, None, :], kept_blocks, axis=2)  # [B, KVH, K]
    heads = jnp.arange(kvh)[None, :, None]
    keys = k_pages[physical, heads].astype(jnp.float32)  # [B, KVH, K, ps, hd]
    values = v_pages[physical, heads].astype(jnp.float32)
    positions = kept_blocks[..., None] * ps + jnp.arange(ps)  # [B, KVH, K, ps]
    valid = (positions < lengths[:, None, None, None]) & (
        jnp.arange(k)[None, None, :, None] < kept_counts[..., None, None]
    )
    qg = q.astype(jnp.float32).reshape(b, kvh, group, hd)
    scores = jnp.einsum("bhgd,bhksd->bhgks", qg, keys) / jnp.sqrt(jnp.float32(hd))
    scores = jnp.where(valid[:, :, None], scores, -jnp.inf)
    flat = scores.reshape(b, kvh, group, k * ps)
    probs = jax.nn.softmax(flat, axis=-1)
    # A (sequence, head) with no valid key at all has no distribution: output 0.
    probs = jnp.where(jnp.isnan(probs), 0.0, probs).reshape(b, kvh, group, k, ps)
    out = jnp.einsum("bhgks,bhksd->bhgd", probs, values)
    block_mass = probs.sum(axis=-1).mean(axis=2)  # [B, KVH, K]
    return out.reshape(b, h, hd).astype(q.dtype), block_mass
