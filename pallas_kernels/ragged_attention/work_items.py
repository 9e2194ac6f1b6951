"""The host's description of a ragged attention pass: query tiles and (tile, key tile) items.

Built in NumPy on the host (as JAX's splash attention builds its block masks), sent to the
device as small int32 arrays whose shapes are fixed by capacities, never by context lengths.

A pass splits each sequence's new tokens into query tiles of `q_tile` tokens (a tile never
mixes sequences) and pairs every tile with the key tiles it can see: runs of `kv_tile`
consecutive logical pages of its sequence, from page 0 to the page of the tile's last
position. The causal part of a prefill chunk is therefore read once per query tile, and a
decode token reads its own pages only, not the widest row's.

Two passes usually make a step: decode segments (a few tokens each) with small query tiles,
and prefill chunks with large ones, so neither pads to the other's shape.

With a sliding window of W positions (a model's local layers), a tile's key tiles start at
the one holding its first token's position - W + 1: pages wholly behind every query's window
are never listed, so a local layer reads about W positions per token whatever the context.

Decode rows that hold the same first pages (a prefix cache's shared beginning: the n samples
of a prompt, questions about one document) can read those pages once for all of them
(cascade attention): a shared pass (`build_shared_pass`) stacks the rows' tokens into one
query tile against the shared pages, and each row's own pass starts after them
(`Segment.skip_pages`). A token is then in two tiles; the kernel merges its partial results
by their log-sum-exps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

NULL_PAGE = 0  # never allocated; pads item page lists (its keys are masked by position)


@dataclass(frozen=True)
class Segment:
    """One sequence's new tokens in the flat batch.

    token_start: index of its first token in the flat batch; num_tokens: how many (>= 1);
    first_position: absolute position of the first; last_position: the furthest position its
    queries reach while this description is used (first_position + num_tokens - 1 for one
    step; more for a K-step decode burst, whose positions advance on the device);
    pages: the sequence's pages in logical order, covering `last_position`.
    skip_pages: its first pages another pass reads (a shared prefix, `build_shared_pass`),
      a multiple of the pass's kv_tile; this pass lists only the key tiles after them.
    """

    token_start: int
    num_tokens: int
    first_position: int
    last_position: int
    pages: Sequence[int]
    skip_pages: int = 0


@dataclass(frozen=True)
class SharedPrefix:
    """Pages several decode tokens all see whole: `tokens` (flat indices, one per row, at
    positions past the pages) read `pages` (logical order from the sequences' page 0)."""

    tokens: Sequence[int]
    pages: Sequence[int]


class TilePass(NamedTuple):
    """One pass of the XLA backend (device or host arrays). Nq tiles of Qt tokens, W items of
    Kt pages; W is a multiple of the loop's chunk."""

    tile_tokens: np.ndarray  # [Nq, Qt] int32 flat token index, T (out of range) for padding
    item_tile: np.ndarray  # [W] int32 the query tile of each item
    item_pages: np.ndarray  # [W, Kt] int32 physical pages of the item's key tile
    item_key_start: np.ndarray  # [W] int32 position of the key tile's first key
    num_items: np.ndarray  # [] int32 real items (the rest is padding the loop never runs)


def build_pass(
    segments: Sequence[Segment],
    *,
    page_size: int,
    q_tile: int,
    kv_tile: int,
    num_tokens: int,
    max_tiles: int,
    max_items: int,
    window: int = 0,
) -> TilePass:
    """Describe the attention of `segments` (tokens of a flat batch of `num_tokens`) as at most
    `max_tiles` query tiles and `max_items` items; raises ValueError when they do not fit.
    `window` > 0: list only the key tiles a sliding window of that many positions can see."""
    tile_tokens = np.full((max_tiles, q_tile), num_tokens, np.int32)
    item_tile = np.zeros(max_items, np.int32)
    item_pages = np.full((max_items, kv_tile), NULL_PAGE, np.int32)
    item_key_start = np.zeros(max_items, np.int32)
    tiles = items = 0
    for seg in segments:
        extra = seg.last_position - (seg.first_position + seg.num_tokens - 1)
        if seg.num_tokens < 1 or extra < 0:
            raise ValueError(f"segment {seg}: needs num_tokens >= 1 and a reach past its tokens")
        if len(seg.pages) * page_size <= seg.last_position:
            raise ValueError(
                f"segment at token {seg.token_start}: {len(seg.pages)} pages do not cover "
                f"position {seg.last_position}"
            )
        if seg.skip_pages % kv_tile:
            raise ValueError(f"segment {seg}: skip_pages is not a multiple of kv_tile={kv_tile}")
        pages = np.asarray(seg.pages, np.int32)
        for first in range(0, seg.num_tokens, q_tile):
            count = min(q_tile, seg.num_tokens - first)
            if tiles == max_tiles:
                raise ValueError(f"more than max_tiles={max_tiles} query tiles")
            tile_tokens[tiles, :count] = seg.token_start + first + np.arange(count)
            reach = seg.first_position + first + count - 1 + extra
            end_tile = (reach // page_size) // kv_tile + 1
            # The first key tile any of the tile's queries sees.
            oldest = max(seg.first_position + first - window + 1, 0) if window > 0 else 0
            start_tile = max((oldest // page_size) // kv_tile, seg.skip_pages // kv_tile)
            key_tiles = end_tile - start_tile
            if items + key_tiles > max_items:
                raise ValueError(f"more than max_items={max_items} work items")
            span = slice(items, items + key_tiles)
            item_tile[span] = tiles
            item_key_start[span] = np.arange(start_tile, end_tile) * kv_tile * page_size
            padded = np.full(end_tile * kv_tile, NULL_PAGE, np.int32)
            visible = min(len(pages), end_tile * kv_tile)
            padded[:visible] = pages[:visible]
            item_pages[span] = padded[start_tile * kv_tile :].reshape(key_tiles, kv_tile)
            items += key_tiles
            tiles += 1
    return TilePass(tile_tokens, item_tile, item_pages, item_key_start, np.asarray(items, np.int32))


def build_shared_pass(
    prefixes: Sequence[SharedPrefix],
    *,
    page_size: int,
    q_tile: int,
    kv_tile: int,
    num_tokens: int,
    max_tiles: int,
    max_items: int,
) -> TilePass:
    """The pass that reads each shared prefix once for the tokens that hold it: one query tile
    per prefix (at most `q_tile` tokens; the planner splits larger groups), its items the
    prefix's key tiles (a whole number of them). Raises ValueError when they do not fit."""
    tile_tokens = np.full((max_tiles, q_tile), num_tokens, np.int32)
    item_tile = np.zeros(max_items, np.int32)
    item_pages = np.full((max_items, kv_tile), NULL_PAGE, np.int32)
    item_key_start = np.zeros(max_items, np.int32)
    items = 0
    if len(prefixes) > max_tiles:
        raise ValueError(f"more than max_tiles={max_tiles} shared prefixes")
    for tile, prefix in enumerate(prefixes):
        if not 0 < len(prefix.tokens) <= q_tile or len(prefix.pages) % kv_tile:
            raise ValueError(
                f"shared prefix {prefix}: needs 1 to q_tile={q_tile} tokens and a whole number "
                f"of kv_tile={kv_tile} pages"
            )
        key_tiles = len(prefix.pages) // kv_tile
        if items + key_tiles > max_items:
            raise ValueError(f"more than max_items={max_items} work items")
        tile_tokens[tile, : len(prefix.tokens)] = prefix.tokens
        span = slice(items, items + key_tiles)
        item_tile[span] = tile
        item_key_start[span] = np.arange(key_tiles) * kv_tile * page_size
        item_pages[span] = np.asarray(prefix.pages, np.int32).reshape(key_tiles, kv_tile)
        items += key_tiles
    return TilePass(tile_tokens, item_tile, item_pages, item_key_start, np.asarray(items, np.int32))


def items_capacity(max_items: int, chunk: int) -> int:
    """`max_items` rounded up to whole loop chunks (the loop slices `chunk` items at a time)."""
    return max(chunk, -(-max_items // chunk) * chunk)
