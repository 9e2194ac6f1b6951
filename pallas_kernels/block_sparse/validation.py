"""Input checks shared by every backend, so they all fail the same way on bad shapes."""

from __future__ import annotations

import jax


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
    if kept_blocks.ndim != 3 or kept_blocks.shape[:2] != (b, kvh):
        raise ValueError(
            f"kept_blocks must be [batch={b}, kv_heads={kvh}, kept], got {kept_blocks.shape}"
        )
    if kept_counts.shape != (b, kvh):
        raise ValueError(
            f"kept_counts must be [batch={b}, kv_heads={kvh}], got {kept_counts.shape}"
        )
    if lengths.shape != (b,):
        raise ValueError(f"lengths must be [batch={b}], got {lengths.shape}")
