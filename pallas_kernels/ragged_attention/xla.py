"""Ragged paged attention in XLA: the portable backend and the fast one on CPU.

Split-KV work items with an online-softmax merge. A `lax.fori_loop` whose trip count is the
number of real items (a traced value) walks the item list `chunk` items at a time: each chunk
gathers its key tiles and query tiles, scores them, and folds its partial softmax into running
per-tile accumulators (max, normaliser, weighted values). Items never cross sequences, so each
token only reads its own sequence's pages, and only those at or before its position (the
causal part of a prefill chunk, the real length of a decode row). The loop's shape is fixed by
the capacities, so one program serves every mix of context lengths.

Accumulation is float32. Masked scores take a large finite negative, not -inf, so a tile with
no visible key in a chunk contributes nothing and never produces NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_attention.work_items import TilePass

_MASKED = -1e30


def ragged_attention_xla(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    q_positions: jax.Array,
    passes: tuple[TilePass, ...],
    chunk: int = 16,
) -> jax.Array:
    """q: [T, H, hd]; k_pages, v_pages: [N, KVH, ps, hd]; q_positions: [T] int32; `passes`
    together cover every real token once (work_items.py). Returns [T, H, hd] in q's dtype;
    tokens in no tile get zeros."""
    t, h, hd = q.shape
    out = jnp.zeros((t, h, hd), jnp.float32)
    for tile_pass in passes:
        part = _run_pass(q, k_pages, v_pages, q_positions, tile_pass, chunk)  # [Nq, Qt, H, hd]
        tokens = tile_pass.tile_tokens.reshape(-1)
        out = out.at[tokens].add(part.reshape(-1, h, hd), mode="drop")
    return out.astype(q.dtype)


def _run_pass(q, k_pages, v_pages, q_positions, tile_pass: TilePass, chunk: int) -> jax.Array:
    _, h, hd = q.shape
    _, kvh, ps, _ = k_pages.shape
    g = h // kvh
    tile_tokens, item_tile, item_pages, item_key_start, num_items = map(jnp.asarray, tile_pass)
    nq, qt = tile_tokens.shape
    w, kt = item_pages.shape
    if w % chunk:
        raise ValueError(f"{w} items is not a multiple of the chunk {chunk}")
    # Query tiles, pre-scaled: [Nq, Qt, KVH, G, hd]; positions [Nq, Qt] (-1 sees nothing).
    queries = q.astype(jnp.float32).at[tile_tokens].get(mode="fill", fill_value=0.0)
    queries = (queries * hd**-0.5).reshape(nq, qt, kvh, g, hd)
    positions = q_positions.at[tile_tokens].get(mode="fill", fill_value=-1)
    key_offsets = jnp.arange(kt * ps, dtype=jnp.int32)

    def body(i, carry):
        best, norm, acc = carry  # [Nq, Qt, KVH, G], same, [Nq, Qt, KVH, G, hd]
        start = i * chunk
        tiles = jax.lax.dynamic_slice_in_dim(item_tile, start, chunk)
        pages = jax.lax.dynamic_slice_in_dim(item_pages, start, chunk)
        key_start = jax.lax.dynamic_slice_in_dim(item_key_start, start, chunk)
        real = start + jnp.arange(chunk) < num_items
        # [C, Kt, KVH, ps, hd] -> [C, KVH, Kt * ps, hd]
        keys = k_pages[pages].transpose(0, 2, 1, 3, 4).reshape(chunk, kvh, kt * ps, hd)
        values = v_pages[pages].transpose(0, 2, 1, 3, 4).reshape(chunk, kvh, kt * ps, hd)
        key_pos = key_start[:, None] + key_offsets  # [C, Kt * ps]
        visible = key_pos[:, None, :] <= positions[tiles][:, :, None]  # [C, Qt, Kt * ps]
        visible = (visible & real[:, None, None])[:, :, None, None, :]
        scores = jnp.einsum(
            "cqkgd,cksd->cqkgs", queries[tiles], keys, preferred_element_type=jnp.float32
        )
        scores = jnp.where(visible, scores, _MASKED)
        new_best = best.at[tiles].max(scores.max(axis=-1))
        rescale = jnp.exp(best - new_best)
        weights = jnp.where(visible, jnp.exp(scores - new_best[tiles][..., None]), 0.0)
        norm = (norm * rescale).at[tiles].add(weights.sum(axis=-1))
        part = jnp.einsum(
            "cqkgs,cksd->cqkgd",
            weights,
            values.astype(jnp.float32),
            preferred_element_type=jnp.float32,
        )
        acc = (acc * rescale[..., None]).at[tiles].add(part)
        return new_best, norm, acc

    init = (
        jnp.full((nq, qt, kvh, g), _MASKED, jnp.float32),
        jnp.zeros((nq, qt, kvh, g), jnp.float32),
        jnp.zeros((nq, qt, kvh, g, hd), jnp.float32),
    )
    trips = (num_items + chunk - 1) // chunk
    _, norm, acc = jax.lax.fori_loop(0, trips, body, init)
    out = acc / jnp.where(norm > 0, norm, 1.0)[..., None]
    return out.reshape(nq, qt, h, hd)
