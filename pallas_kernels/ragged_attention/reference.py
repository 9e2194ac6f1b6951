"""Ragged paged attention, float32 and plain: the truth the other backends are tested against."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def ragged_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    q_positions: jax.Array,
    token_seq: jax.Array,
    page_table: jax.Array,
    window: int = 0,
    softcap: float = 0.0,
) -> jax.Array:
    """Each token attends to its sequence's keys at positions <= its own (and, with a sliding
    `window` > 0, > its own minus the window: the last `window` positions). With `softcap`
    > 0, each scaled score s is softcap * tanh(s / softcap) before the softmax (Gemma 2).

    q: [T, H, hd]; k_pages, v_pages: [N, KVH, ps, hd]; q_positions: [T] int32; token_seq: [T]
    int32 row of `page_table` [S, P] holding the token's sequence, < 0 for padding tokens.
    Returns [T, H, hd] float32 (zeros for padding tokens).
    """
    t, h, hd = q.shape
    _, kvh, ps, _ = k_pages.shape
    p = page_table.shape[1]
    table = page_table[jnp.clip(token_seq, 0, None)]  # [T, P]
    keys = k_pages[table].astype(jnp.float32)  # [T, P, KVH, ps, hd]
    values = v_pages[table].astype(jnp.float32)
    keys = keys.transpose(0, 2, 1, 3, 4).reshape(t, kvh, p * ps, hd)
    values = values.transpose(0, 2, 1, 3, 4).reshape(t, kvh, p * ps, hd)
    qg = q.astype(jnp.float32).reshape(t, kvh, h // kvh, hd)
    scores = jnp.einsum("tkgd,tksd->tkgs", qg, keys) * hd**-0.5
    if softcap:
        scores = softcap * jnp.tanh(scores / softcap)
    key_pos = jnp.arange(p * ps)[None, :]
    visible = key_pos <= q_positions[:, None]  # [T, P * ps]
    if window:
        visible &= key_pos > q_positions[:, None] - window
    visible &= (token_seq >= 0)[:, None]
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(visible[:, None, None], probs, 0.0)  # fully masked rows: 0, not NaN
    out = jnp.einsum("tkgs,tksd->tkgd", probs, values)
    return out.reshape(t, h, hd)
