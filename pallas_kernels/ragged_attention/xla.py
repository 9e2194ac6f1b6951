"""Ragged paged attention in XLA: the portable backend and the fast one on CPU.

Split-KV work items with an online-softmax merge, in two loop shapes chosen by a pass's query
tile (a static size):

- One-token tiles (decode): a `lax.fori_loop` whose trip count is the number of real items (a
  traced value) walks the item list `chunk` items at a time: each trip gathers its key tiles
  and query tokens, scores them, and folds its partial softmax into running per-tile
  accumulators (max, normaliser, weighted values) with scatters. A decode item is small, so
  batching `chunk` of them per trip is what amortises the loop; a second loop takes the
  items after the last full chunk `TAIL_CHUNK` at a time, so a few real items (one row over a
  short context) do not pay for a whole chunk of padding.
- Wide tiles (prefill chunks): an outer loop over the real query tiles and an inner loop over
  that tile's items, the accumulators of one tile carried in registers of the loop, so no trip
  scatters into or rescales the accumulators of the others. Each trip is one product of the
  tile's queries (all heads of a KV group stacked as rows) against the item's keys. On this
  2-core CPU this ran a 512-token chunk after 3584 cached tokens in 25 ms per layer against
  63 ms for the chunked item loop (plan.py has the tiling's measurements). An item whose keys
  are all visible to every query of its tile (all of a long chunk's items but those on its
  diagonal) skips the mask, a select over the whole score tile before the max and another
  after the exponential.

A token may also be in the tile of a shared pass: a decode row whose first pages other rows
share reads them there, one tile for all those rows, and the rest in its own pass (cascade
attention, work_items.py). Each pass returns its tiles' outputs with their log-sum-exps; the
shared pass is merged with the others token by token through them, while plans without one
add their passes' outputs as before (the log-sum-exps then go unused and are never computed).

Items never cross sequences, so each token only reads its own sequence's pages, and only those
at or before its position (the causal part of a prefill chunk, the real length of a decode
row). Loop shapes are fixed by the capacities, so one program serves every mix of lengths.
A sliding `window` (a traced scalar: one program serves local and global layers, 0 = none)
also hides keys `window` or more positions behind the query; which pages are read at all is
the plan's business (`build_pass(window=...)` lists only the window's key tiles).

Accumulation is float32. Masked scores take a large finite negative, not -inf, so a tile with
no visible key in an item contributes nothing and never produces NaN.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_attention.work_items import TilePass

_MASKED = -1e30
# Passes whose query tiles hold at least this many tokens run the tile loop.
TILE_LOOP_MIN_QUERIES = 16
# The one-token loop's items per trip after its full chunks. A trip costs about as much as an
# item (~17 us each per layer on a 2-core Xeon), so the last partial chunk runs in trips of
# this many: a batch-1 decode step over a short context (one real item) then pays for 4 items
# per layer, not 16 (SmolLM2: 33 ms a step before, 27 ms after; its matrix products alone take
# 24 ms. docs/PERF.md, "step_floor").
TAIL_CHUNK = 4


def ragged_attention_xla(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    q_positions: jax.Array,
    passes: tuple[TilePass, ...],
    chunk: int = 16,
    window: jax.Array | int = 0,
    softcap: float = 0.0,
    shared_last: bool = False,
    native_pass: Callable | None = None,
) -> jax.Array:
    """q: [T, H, hd]; k_pages, v_pages: [N, KVH, ps, hd]; q_positions: [T] int32; `passes`
    together cover every real token once (work_items.py), except that with `shared_last`
    (static) the last pass is a shared pass (`build_shared_pass`) whose tokens the others
    also hold; window: a sliding window in positions (0: none); softcap: scores s become
    softcap * tanh(s / softcap) (Gemma 2; 0: none); native_pass: runs every pass, the shared
    one too, instead of the XLA loops, with `_run_pass`'s arguments and results less the
    chunk (cpu.py's `ragged_pass_cpu`). Returns [T, H, hd] in q's dtype; tokens in no tile
    get zeros."""
    t, h, hd = q.shape
    own, shared = (passes[:-1], passes[-1]) if shared_last else (passes, None)
    out = jnp.zeros((t, h, hd), jnp.float32)
    lse = jnp.full((t, h), _MASKED, jnp.float32)
    for tile_pass in own:
        part, part_lse = _run_pass(
            q, k_pages, v_pages, q_positions, tile_pass, chunk, window, softcap, native_pass
        )
        tokens = tile_pass.tile_tokens.reshape(-1)
        out = out.at[tokens].add(part.reshape(-1, h, hd), mode="drop")
        if shared is not None:  # (unused, and so never computed, without a shared pass)
            lse = lse.at[tokens].set(part_lse.reshape(-1, h), mode="drop")
    if shared is not None:
        part, part_lse = _run_pass(
            q, k_pages, v_pages, q_positions, shared, chunk, window, softcap, native_pass
        )
        tokens = shared.tile_tokens.reshape(-1)
        part = jnp.zeros_like(out).at[tokens].set(part.reshape(-1, h, hd), mode="drop")
        part_lse = jnp.full_like(lse, _MASKED).at[tokens].set(part_lse.reshape(-1, h), mode="drop")
        merged = jnp.logaddexp(lse, part_lse)
        out = out * jnp.exp(lse - merged)[..., None] + part * jnp.exp(part_lse - merged)[..., None]
    return out.astype(q.dtype)


def _run_pass(
    q, k_pages, v_pages, q_positions, tile_pass: TilePass, chunk, window, softcap, native_pass
):
    # -> the pass's tiles' outputs [Nq, Qt, H, hd] and log-sum-exps [Nq, Qt, H]
    if native_pass is not None:
        return native_pass(q, k_pages, v_pages, q_positions, tile_pass, window, softcap)
    wide = tile_pass.tile_tokens.shape[1] >= TILE_LOOP_MIN_QUERIES
    run = _tile_loop_pass if wide else _item_chunk_pass
    return run(q, k_pages, v_pages, q_positions, tile_pass, chunk, window, softcap)


def _normalised(best: jax.Array, norm: jax.Array, acc: jax.Array):
    # A tile's softmax state -> its output and log-sum-exp (-inf-like where it saw no key).
    seen = norm > 0
    out = acc / jnp.where(seen, norm, 1.0)[..., None]
    return out, jnp.where(seen, best + jnp.log(jnp.where(seen, norm, 1.0)), _MASKED)


def visible_keys(key_pos: jax.Array, q_pos: jax.Array, window: jax.Array | int) -> jax.Array:
    """Whether a query at `q_pos` sees a key at `key_pos` (broadcast): at or before it, and
    within the last `window` positions when window > 0."""
    seen = key_pos <= q_pos
    if isinstance(window, int) and window == 0:
        return seen
    return seen & ((window <= 0) | (key_pos > q_pos - window))


def soft_capped(scores: jax.Array, softcap: float) -> jax.Array:
    """softcap * tanh(scores / softcap): scores squashed into (-softcap, softcap), as Gemma 2
    caps its attention logits; scores as they are when softcap is 0."""
    return scores if not softcap else softcap * jnp.tanh(scores / softcap)


def _item_chunk_pass(
    q, k_pages, v_pages, q_positions, tile_pass: TilePass, chunk: int, window, softcap
) -> jax.Array:
    _, h, hd = q.shape
    _, kvh, ps, _ = k_pages.shape
    g = h // kvh
    tile_tokens, item_tile, item_pages, item_key_start, num_items = map(jnp.asarray, tile_pass)
    nq, qt = tile_tokens.shape
    w, kt = item_pages.shape
    if w % chunk:
        raise ValueError(f"{w} items is not a multiple of the chunk {chunk}")
    if w == chunk:
        # With one chunk of items, the full-chunk loop's slices are loop-invariant: XLA:CPU
        # hoists its gather of the pages out of the loop, fuses it with the layer's cache
        # write and then copies the whole pool twice per layer (a batch-1 step over a
        # 256-page pool took 373 ms instead of 29). Padding items keep the slices moving.
        item_tile, item_pages, item_key_start = (
            jnp.concatenate([a, jnp.zeros_like(a)]) for a in (item_tile, item_pages, item_key_start)
        )
        w *= 2
    # Query tiles, pre-scaled: [Nq, Qt, KVH, G, hd]; positions [Nq, Qt] (-1 sees nothing).
    queries = q.astype(jnp.float32).at[tile_tokens].get(mode="fill", fill_value=0.0)
    queries = (queries * hd**-0.5).reshape(nq, qt, kvh, g, hd)
    positions = q_positions.at[tile_tokens].get(mode="fill", fill_value=-1)
    key_offsets = jnp.arange(kt * ps, dtype=jnp.int32)

    def trip(start, size, carry):
        # Items [start, start + size) into the accumulators.
        best, norm, acc = carry  # [Nq, Qt, KVH, G], same, [Nq, Qt, KVH, G, hd]
        tiles = jax.lax.dynamic_slice_in_dim(item_tile, start, size)
        pages = jax.lax.dynamic_slice_in_dim(item_pages, start, size)
        key_start = jax.lax.dynamic_slice_in_dim(item_key_start, start, size)
        real = start + jnp.arange(size) < num_items
        # [C, Kt, KVH, ps, hd] -> [C, KVH, Kt * ps, hd]
        keys = k_pages[pages].transpose(0, 2, 1, 3, 4).reshape(size, kvh, kt * ps, hd)
        values = v_pages[pages].transpose(0, 2, 1, 3, 4).reshape(size, kvh, kt * ps, hd)
        key_pos = key_start[:, None] + key_offsets  # [C, Kt * ps]
        visible = visible_keys(key_pos[:, None, :], positions[tiles][:, :, None], window)
        visible = (visible & real[:, None, None])[:, :, None, None, :]
        # Products with the (item, KV head) batch dimensions leading and a tile's queries
        # (tokens x heads of the group) as rows, as XLA:CPU's fast batched-product path wants.
        rows = queries[tiles].transpose(0, 2, 1, 3, 4).reshape(size, kvh, qt * g, hd)
        scores = jnp.einsum("ckrd,cksd->ckrs", rows, keys, preferred_element_type=jnp.float32)
        scores = scores.reshape(size, kvh, qt, g, -1).transpose(0, 2, 1, 3, 4)
        scores = jnp.where(visible, soft_capped(scores, softcap), _MASKED)
        new_best = best.at[tiles].max(scores.max(axis=-1))
        rescale = jnp.exp(best - new_best)
        weights = jnp.where(visible, jnp.exp(scores - new_best[tiles][..., None]), 0.0)
        norm = (norm * rescale).at[tiles].add(weights.sum(axis=-1))
        weight_rows = weights.transpose(0, 2, 1, 3, 4).reshape(size, kvh, qt * g, -1)
        part = jnp.einsum(
            "ckrs,cksd->ckrd",
            weight_rows,
            values.astype(jnp.float32),
            preferred_element_type=jnp.float32,
        )
        part = part.reshape(size, kvh, qt, g, hd).transpose(0, 2, 1, 3, 4)
        acc = (acc * rescale[..., None]).at[tiles].add(part)
        return new_best, norm, acc

    init = (
        jnp.full((nq, qt, kvh, g), _MASKED, jnp.float32),
        jnp.zeros((nq, qt, kvh, g), jnp.float32),
        jnp.zeros((nq, qt, kvh, g, hd), jnp.float32),
    )
    # Full chunks, then the rest in trips of TAIL_CHUNK (or of `chunk`, when smaller).
    full = num_items // chunk
    carry = jax.lax.fori_loop(0, full, lambda i, c: trip(i * chunk, chunk, c), init)
    tail = min(TAIL_CHUNK, chunk)
    if chunk % tail:
        raise ValueError(f"the chunk {chunk} is not a multiple of the tail chunk {tail}")
    rest = (num_items - full * chunk + tail - 1) // tail
    carry = jax.lax.fori_loop(0, rest, lambda i, c: trip(full * chunk + i * tail, tail, c), carry)
    out, lse = _normalised(*carry)
    return out.reshape(nq, qt, h, hd), lse.reshape(nq, qt, h)


def _tile_loop_pass(
    q, k_pages, v_pages, q_positions, tile_pass: TilePass, chunk: int, window, softcap
):
    del chunk  # one item per inner trip: a wide tile's product is large enough on its own
    _, h, hd = q.shape
    _, kvh, ps, _ = k_pages.shape
    g = h // kvh
    tile_tokens, item_tile, item_pages, item_key_start, num_items = map(jnp.asarray, tile_pass)
    nq, qt = tile_tokens.shape
    w, kt = item_pages.shape
    # build_pass emits a tile's items together and tiles in order from 0, so tile j's items
    # are [first[j], first[j + 1]) and the tiles with items are the first `num_tiles`.
    real = jnp.arange(w) < num_items
    counts = jnp.zeros(nq, jnp.int32).at[item_tile].add(real.astype(jnp.int32))
    first = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(counts)])
    num_tiles = jnp.sum(counts > 0)
    key_offsets = jnp.arange(kt * ps, dtype=jnp.int32)

    def tile_body(j, results):
        out, lse = results
        tokens = tile_tokens[j]
        # The tile's queries as rows per KV head: [KVH, Qt * G, hd], pre-scaled.
        queries = q.astype(jnp.float32).at[tokens].get(mode="fill", fill_value=0.0)
        queries = queries.reshape(qt, kvh, g, hd).transpose(1, 0, 2, 3) * hd**-0.5
        queries = queries.reshape(kvh, qt * g, hd)
        positions = q_positions.at[tokens].get(mode="fill", fill_value=-1)  # -1 sees nothing
        row_positions = jnp.repeat(positions, g)  # [Qt * G], row order (token, group)
        # The tile's real queries span [first_query, last_query]; padding rows (-1) are
        # dropped by the caller, so what they compute does not matter.
        first_query = jnp.min(jnp.where(positions >= 0, positions, jnp.iinfo(jnp.int32).max))
        last_query = jnp.max(positions)

        def item_body(i, carry):
            best, norm, acc = carry  # [KVH, Qt * G], same, [KVH, Qt * G, hd]
            pages = item_pages[i]
            keys = k_pages[pages].transpose(1, 0, 2, 3).reshape(kvh, kt * ps, hd)
            values = v_pages[pages].transpose(1, 0, 2, 3).reshape(kvh, kt * ps, hd)
            key_pos = item_key_start[i] + key_offsets
            scores = jnp.einsum("krd,ksd->krs", queries, keys, preferred_element_type=jnp.float32)
            scores = soft_capped(scores, softcap)

            def merge(visible):
                # Fold the item's scores into the tile's online softmax; `visible` None: every
                # key is visible to every real query.
                masked = scores if visible is None else jnp.where(visible, scores, _MASKED)
                new_best = jnp.maximum(best, masked.max(axis=-1))
                rescale = jnp.exp(best - new_best)
                weights = jnp.exp(masked - new_best[..., None])
                if visible is not None:
                    weights = jnp.where(visible, weights, 0.0)
                part = jnp.einsum(
                    "krs,ksd->krd",
                    weights,
                    values.astype(jnp.float32),
                    preferred_element_type=jnp.float32,
                )
                return (
                    new_best,
                    norm * rescale + weights.sum(axis=-1),
                    acc * rescale[..., None] + part,
                )

            # Most items of a long chunk lie wholly before its first query and inside any
            # window: they skip the mask's passes over the [KVH, Qt * G, Kt * ps] scores (a
            # 512-token chunk after 4K tokens: 18 of its 22 items).
            inside = key_pos[-1] <= first_query
            if not (isinstance(window, int) and window == 0):
                inside &= (window <= 0) | (key_pos[0] > last_query - window)
            return jax.lax.cond(
                inside,
                lambda: merge(None),
                lambda: merge(visible_keys(key_pos[None, :], row_positions[:, None], window)[None]),
            )

        init = (
            jnp.full((kvh, qt * g), _MASKED, jnp.float32),
            jnp.zeros((kvh, qt * g), jnp.float32),
            jnp.zeros((kvh, qt * g, hd), jnp.float32),
        )
        tile_out, tile_lse = _normalised(
            *jax.lax.fori_loop(first[j], first[j + 1], item_body, init)
        )
        tile_out = tile_out.reshape(kvh, qt, g, hd).transpose(1, 0, 2, 3).reshape(qt, h, hd)
        tile_lse = tile_lse.reshape(kvh, qt, g).transpose(1, 0, 2).reshape(qt, h)
        return (
            jax.lax.dynamic_update_index_in_dim(out, tile_out, j, axis=0),
            jax.lax.dynamic_update_index_in_dim(lse, tile_lse, j, axis=0),
        )

    results = (jnp.zeros((nq, qt, h, hd), jnp.float32), jnp.full((nq, qt, h), _MASKED, jnp.float32))
    return jax.lax.fori_loop(0, num_tiles, tile_body, results)
