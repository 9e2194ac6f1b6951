"""Paged attention with XLA gathers: the portable path and the fast path on CPU.

The pages of each sequence are gathered into a contiguous view and attended with a causal mask
on absolute positions. The same function serves prefill (many queries per sequence, possibly
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
      k_pages, v_pages: [N, KVH, page_size, hd] the page pool of one layer.
      page_table: [B, P] int32 page ids; logical position t of sequence b lives in page
        `page_table[b, t // page_size]` at slot `t % page_size`.
      q_positions: [B, S] int32 absolute position of each query. Keys at positions greater than
        a query's are masked out, which also hides stale slots and unused page-table entries.

    Returns:
      [B, S, H, hd] attention output in q's dtype; softmax and accumulation are float32.
    """
    b, s, h, hd = q.shape
    _, kvh, page_size, _ = k_pages.shape
    num_keys = page_table.shape[1] * page_size
    visible = jnp.arange(num_keys, dtype=jnp.int32)[None, None, :] <= q_positions[:, :, None]
    q_grouped = q.reshape(b, s, kvh, h // kvh, hd)
    if s == 1:
        out = _attend_one_query(q_grouped, k_pages[page_table], v_pages[page_table], visible)
    else:
        # [B, P, KVH, ps, hd] -> [B, T, KVH, hd]
        keys = k_pages[page_table].transpose(0, 1, 3, 2, 4).reshape(b, num_keys, kvh, hd)
        values = v_pages[page_table].transpose(0, 1, 3, 2, 4).reshape(b, num_keys, kvh, hd)
        out = _attend_many_queries(q_grouped, keys, values, visible)
    return out.reshape(b, s, h, hd).astype(q.dtype)


def _attend_many_queries(q, keys, values, visible):
    # q: [B, S, KVH, G, hd]; keys, values: [B, T, KVH, hd]; visible: [B, S, T] -> [B, S, KVH, G, hd]
    hd = q.shape[-1]
    scores = jnp.einsum("bskgd,btkd->bkgst", q, keys, preferred_element_type=jnp.float32)
    scores = jnp.where(visible[:, None, None], scores * hd**-0.5, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum(
        "bkgst,btkd->bskgd", probs.astype(values.dtype), values, preferred_element_type=jnp.float32
    )


def _attend_one_query(q, key_pages, value_pages, visible):
    # Decode: with one query per sequence the products are [G, hd] x [hd, T] per KV head, too
    # small for a matrix-product call. As multiply-and-reduce, XLA fuses the page gather into the
    # reduction instead of materialising the gathered keys and values first.
    # q: [B, 1, KVH, G, hd]; key_pages, value_pages: [B, P, KVH, ps, hd]; visible: [B, 1, T].
    b, p, _, ps, hd = key_pages.shape
    q32 = q[:, 0, None, :, :, None, :].astype(jnp.float32)  # [B, 1, KVH, G, 1, hd]
    keys = key_pages[:, :, :, None].astype(jnp.float32)  # [B, P, KVH, 1, ps, hd]
    scores = jnp.sum(q32 * keys, axis=-1) * hd**-0.5  # [B, P, KVH, G, ps]
    mask = visible[:, 0].reshape(b, p, 1, 1, ps)
    scores = jnp.where(mask, scores, -jnp.inf)
    peak = jnp.max(scores, axis=(1, 4), keepdims=True)
    weights = jnp.exp(scores - peak)
    total = jnp.sum(weights, axis=(1, 4), keepdims=True)
    values = value_pages[:, :, :, None].astype(jnp.float32)  # [B, P, KVH, 1, ps, hd]
    out = jnp.sum(weights[..., None] * values, axis=(1, 4)) / total[:, 0, :, :, 0, None]
    return out[:, None]  # [B, 1, KVH, G, hd]
