"""Paged attention with XLA gathers: the portable path and the fast path on CPU.

The pages of each sequence are gathered into a contiguous view and attended densely with a causal
mask on absolute positions. The same function serves prefill (many queries per sequence, possibly
continuing a prefix already in the cache) and decode (one query per sequence).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def paged_attention_xla(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    q_positions: jax.Array,
) -> jax.Array:
    """Attend queries to every cached key at an earlier or equal position.

    Args:
      q: [B, S, H, hd] queries (RoPE applied), H a multiple of KVH.
      k_pages, v_pages: [N, page_size, KVH, hd] the page pool of one layer.
      page_table: [B, P] int32 page ids; logical position t of sequence b lives in page
        `page_table[b, t // page_size]` at slot `t % page_size`.
      q_positions: [B, S] int32 absolute position of each query. Keys at positions greater than
        a query's are masked out, which also hides stale slots and unused page-table entries.

    Returns:
      [B, S, H, hd] attention output in q's dtype; softmax and accumulation are float32.
    """
    b, s, h, hd = q.shape
    _, page_size, kvh, _ = k_pages.shape
    num_keys = page_table.shape[1] * page_size
    group = h // kvh

    keys = k_pages[page_table].reshape(b, num_keys, kvh, hd)
    values = v_pages[page_table].reshape(b, num_keys, kvh, hd)
    q_grouped = q.reshape(b, s, kvh, group, hd)

    scores = jnp.einsum(
        "bskgd,btkd->bkgst", q_grouped, keys, preferred_element_type=jnp.float32
    ) * (hd**-0.5)
    key_positions = jnp.arange(num_keys, dtype=jnp.int32)
    visible = key_positions[None, None, :] <= q_positions[:, :, None]  # [B, S, T]
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum(
        "bkgst,btkd->bskgd",
        probs.astype(values.dtype),
        values,
        preferred_element_type=jnp.float32,
    )
    return out.reshape(b, s, h, hd).astype(q.dtype)
