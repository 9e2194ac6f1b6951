"""Input checks shared by every backend, so they all fail the same way on bad shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def check_inputs(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    kept_blocks: jax.Array,
    kept_counts: jax.Array,
    lengths: jax.Array,
) -> None:
    """Raise ValueError naming the argument whose shape does not fit the others."""
    if q.ndim != 3:
        raise ValueError(f"q must be [batch, heads, head_dim], got shape {q.shape}")
    b, h, hd = q.shape
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(
            f"k_pages and v_pages must both be [pages, kv_heads, page_size, head_dim], got "
            f"{k_pages.shape} and {v_pages.shape}"
        )
    _, kvh, _, khd = k_pages.shape
    if khd != hd:
        raise ValueError(f"head_dim of q ({hd}) and k_pages ({khd}) differ")
    if h % kvh:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({kvh})")
    if page_table.ndim != 2 or page_table.shape[0] != b:
        raise ValueError(f"page_table must be [batch={b}, blocks], got {page_table.shape}")
    if kept_blocks.ndim != 3 or kept_blocks.shape[0] != b or kept_blocks.shape[1] not in (1, kvh):
        raise ValueError(
            f"kept_blocks must be [batch={b}, kv_heads={kvh} or 1 (shared), kept], got "
            f"{kept_blocks.shape}"
        )
    if kept_counts.shape != kept_blocks.shape[:2]:
        raise ValueError(
            f"kept_counts must be [batch={b}, {kept_blocks.shape[1]}] like kept_blocks, got "
            f"{kept_counts.shape}"
        )
    if lengths.shape != (b,):
        raise ValueError(f"lengths must be [batch={b}], got {lengths.shape}")


def per_head(kept_blocks: jax.Array, kept_counts: jax.Array, kv_heads: int):
    """Broadcast a selection shared by all KV heads ([B, 1, K], [B, 1]) to one per head."""
    b, _, k = kept_blocks.shape
    return (
        jnp.broadcast_to(kept_blocks, (b, kv_heads, k)),
        jnp.broadcast_to(kept_counts, (b, kv_heads)),
    )
