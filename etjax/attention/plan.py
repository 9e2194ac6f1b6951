"""`AttentionPlan`: what the tokens of one device step attend to, built on the host.

A step's tokens come from sequences (`Segment`s of a flat batch). The plan routes each segment
to a pass by its number of new tokens: decode tokens go to a pass of one-token query tiles,
prefill chunks to a pass of wide tiles, so a decode row never pads to a chunk's shape. Each pass
lists (query tile, key tile) work items over the sequence's own pages only, up to each tile's
last position (pallas_kernels/ragged_attention/work_items.py).

Under pruning the step adds the rows' pruned part, a `SparsePlan`, to the plan it hands the
model (`AttentionPlan.sparse`): the layers read it and the plan's backend says how to prune.

Shapes come from `PlanSizes`, fixed by the engine's sizes and the step's token bucket, never by
context lengths: a new mix of lengths reuses the compiled step. The tile sizes are the
kernel's, timed beside it (pallas_kernels/ragged_attention/tiles.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import flax.struct
import jax
import numpy as np

from etjax.attention.backend import XLA, AttentionBackend
from etjax.attention.cascade import shared_prefixes
from etjax.pruning.config import PruningThresholds
from etjax.pruning.groups import PrunedGroups
from pallas_kernels.ragged_attention.tiles import (
    CHUNK,
    DECODE_KV_TILE,
    LONG_PREFILL_KV_TILE,
    LONG_PREFILL_MIN_TOKENS,
    LONG_PREFILL_Q_TILE,
    PREFILL_KV_TILE,
    PREFILL_Q_TILE,
    SHARED_Q_TILE,
    SHORT_PREFILL_KV_TILE,
    SHORT_PREFILL_Q_TILE,
)
from pallas_kernels.ragged_attention.work_items import (
    Segment,
    SharedPrefix,
    TilePass,
    build_pass,
    build_shared_pass,
    items_capacity,
)


@dataclass(frozen=True)
class PassShape:
    """Static tiling of one pass: tiles of q_tile tokens, items of kv_tile pages; it takes
    segments of up to `max_tokens` new tokens (default: q_tile, one tile each)."""

    q_tile: int
    kv_tile: int
    max_tiles: int
    max_items: int
    max_tokens: int = 0

    @property
    def holds(self) -> int:
        """The most new tokens of a segment routed here."""
        return self.max_tokens or self.q_tile


@dataclass(frozen=True)
class PlanSizes:
    """The static shapes of a step's plan: its passes, in routing order (a segment goes to
    the first pass that holds its tokens, else to the last)."""

    page_size: int
    passes: tuple[PassShape, ...]
    chunk: int = CHUNK
    # The pass that reads decode rows' shared prefixes once for all of them (cascade.py),
    # after `passes`; None: every row reads its own pages.
    shared: PassShape | None = None

    @staticmethod
    def decode(
        rows: int,
        num_pages: int,
        page_size: int,
        q_tile: int = 1,
        *,
        max_seq_pages: int = 0,
        pages_shared: bool = False,
        cascade: bool = False,
    ) -> PlanSizes:
        """One token per row of `rows` (or up to `q_tile`: a token and its drafts), over a
        pool of `num_pages` pages. Rows whose pages are disjoint have at most
        num_pages / kv_tile + rows items; with `pages_shared` (a prefix cache: rows may hold
        the same pages) the bound is per row, from `max_seq_pages`, the longest page list a
        row can have. `cascade`, with one-token rows, two or more of them: also a shared pass
        of up to half the rows' worth of shared prefixes, each at most max_seq_pages long."""
        if (pages_shared or cascade) and not max_seq_pages:
            raise ValueError("pages_shared and cascade need max_seq_pages")
        items = num_pages // DECODE_KV_TILE + rows
        if pages_shared:
            items = rows * (max_seq_pages // DECODE_KV_TILE + 1)
        items = items_capacity(items, CHUNK)
        shared = None
        if cascade and q_tile == 1 and rows >= 2:
            tiles = rows // 2
            shared_items = tiles * (min(max_seq_pages, num_pages) // DECODE_KV_TILE)
            shared = PassShape(
                SHARED_Q_TILE, DECODE_KV_TILE, tiles, items_capacity(shared_items, CHUNK)
            )
        return PlanSizes(
            page_size, (PassShape(q_tile, DECODE_KV_TILE, rows, items),), shared=shared
        )

    @staticmethod
    def prefill(num_tokens: int, rows: int, max_seq_pages: int, page_size: int) -> PlanSizes:
        """Chunks of up to `rows` sequences holding `num_tokens` tokens in all, each sequence
        at most `max_seq_pages` pages long: a pass for short chunks (one tile each), one for
        chunks of up to 256 tokens, and, when the step can hold one, one for longer chunks
        (the tilings' measurements are above)."""

        def items(tiles: int, kv_tile: int) -> int:
            return items_capacity(tiles * -(-max_seq_pages // kv_tile), CHUNK)

        short = PassShape(
            SHORT_PREFILL_Q_TILE, SHORT_PREFILL_KV_TILE, rows, items(rows, SHORT_PREFILL_KV_TILE)
        )
        tiles = num_tokens // PREFILL_Q_TILE + rows
        medium = PassShape(
            PREFILL_Q_TILE,
            PREFILL_KV_TILE,
            tiles,
            items(tiles, PREFILL_KV_TILE),
            max_tokens=LONG_PREFILL_MIN_TOKENS - 1,
        )
        if num_tokens < LONG_PREFILL_MIN_TOKENS:
            return PlanSizes(page_size, (short, medium))
        # Each long chunk's last tile may be partial: one more tile per chunk that fits.
        long_tiles = num_tokens // LONG_PREFILL_Q_TILE + num_tokens // LONG_PREFILL_MIN_TOKENS
        long = PassShape(
            LONG_PREFILL_Q_TILE,
            LONG_PREFILL_KV_TILE,
            long_tiles,
            items(long_tiles, LONG_PREFILL_KV_TILE),
            max_tokens=num_tokens,
        )
        return PlanSizes(page_size, (short, medium, long))

    def route(self, segments: Sequence[Segment]) -> list[list[Segment]]:
        """`segments` grouped by pass: each goes to the first pass that holds its number of
        tokens, else to the last."""
        routed: list[list[Segment]] = [[] for _ in self.passes]
        for seg in segments:
            index = next(
                (i for i, p in enumerate(self.passes) if seg.num_tokens <= p.holds),
                len(self.passes) - 1,
            )
            routed[index].append(seg)
        return routed


@flax.struct.dataclass
class SparsePlan:
    """The pruned decode rows' part of a step's plan (`AttentionPlan.sparse`): per-row block
    budgets and the traced thresholds. The pruning's static settings are the plan backend's
    (`AttentionBackend.pruning`)."""

    budget_blocks: jax.Array  # [B] int32 blocks each row may read (all layers and KV heads)
    page_table: jax.Array  # [B, P] int32 pages of each row's sequence
    thresholds: PruningThresholds
    max_kept: int = flax.struct.field(pytree_node=False)  # static width of the kept table
    # [B] int32 flat index of each row's token in a ragged step (out of range for padding
    # rows); None: the step's tokens are exactly the rows'.
    slots: jax.Array | None = None
    # [B] int32 each row's row of the cache's block mass (the engine's store rows); None: row
    # b is row b.
    rows: jax.Array | None = None
    # [B] float32 the kept fraction the budgets come from, for a row whose tokens reach past
    # its first token's page (a verifying row's drafts: runtime/steps.py `_per_token`).
    fraction: jax.Array | None = None
    # Rows sharing a prefix that select and read it together (etjax/pruning/groups.py);
    # None: each row alone. Only for a step whose tokens are exactly the rows'.
    groups: PrunedGroups | None = None


@flax.struct.dataclass
class AttentionPlan:
    """A step's attention work as arrays (see the module docstring). For a model with
    sliding-window layers, `local` holds the same passes listing only the key tiles within
    `window` positions of each query tile: its local layers run those (`attend(local=...)`),
    its global layers `passes`; the shapes are the same, so one program serves both. `sparse`:
    the pruned rows' part (None: every token attends densely), which the step adds to the
    host's plan (a burst of pruned rows only: to a plan without passes)."""

    passes: tuple[TilePass, ...]
    chunk: int = flax.struct.field(pytree_node=False, default=CHUNK)
    # The kernels that run it (etjax/attention/backend.py).
    backend: AttentionBackend = flax.struct.field(pytree_node=False, default=XLA)
    local: tuple[TilePass, ...] | None = None
    window: int = flax.struct.field(pytree_node=False, default=0)
    # The last of `passes` (and of `local`, there empty) is a shared pass (cascade.py).
    shared: bool = flax.struct.field(pytree_node=False, default=False)
    sparse: SparsePlan | None = None


def plan_segments(
    segments: Sequence[Segment],
    num_tokens: int,
    sizes: PlanSizes,
    backend: AttentionBackend = XLA,
    window: int = 0,
) -> AttentionPlan:
    """The plan of a flat batch of `num_tokens` tokens holding `segments` (host arrays), each
    routed by length (`PlanSizes.route`); run by `backend`'s kernels; with a `window` > 0,
    also the local layers' passes."""
    return plan_passes(sizes.route(segments), num_tokens, sizes, backend, window)


def decode_sharing(
    segments: Sequence[Segment], sizes: PlanSizes
) -> tuple[list[Segment], list[SharedPrefix]]:
    """Which one-token decode `segments` read shared prefixes once (cascade.py), within the
    shared pass of `sizes`: the segments with what each still reads alone, and the groups
    (none without a shared pass)."""
    shape = sizes.shared
    if shape is None:
        return list(segments), []
    return shared_prefixes(
        segments,
        sizes.page_size,
        shape.kv_tile,
        shape.q_tile,
        max_prefixes=shape.max_tiles,
        max_items=shape.max_items,
    )


def plan_decode(
    segments: Sequence[Segment],
    num_tokens: int,
    sizes: PlanSizes,
    backend: AttentionBackend = XLA,
    window: int = 0,
    sharing: tuple[list[Segment], list[SharedPrefix]] | None = None,
) -> AttentionPlan:
    """The plan of one-token decode `segments` (sizes from `PlanSizes.decode`): with a shared
    pass, rows that start with the same pages read them once there (cascade.py) in global
    layers; local layers read each row's window on its own. `sharing`: `decode_sharing`'s
    result for these arguments, when the caller has it already."""
    own, prefixes = sharing if sharing is not None else decode_sharing(segments, sizes)
    if not prefixes:  # the plain plan's program: steps without sharing pay nothing for it
        return plan_segments(
            segments, num_tokens, dataclasses.replace(sizes, shared=None), backend, window
        )
    return plan_passes([own], num_tokens, sizes, backend, window, [segments], prefixes)


def plan_passes(
    groups: Sequence[Sequence[Segment]],
    num_tokens: int,
    sizes: PlanSizes,
    backend: AttentionBackend = XLA,
    window: int = 0,
    local_groups: Sequence[Sequence[Segment]] | None = None,
    shared: Sequence[SharedPrefix] = (),
) -> AttentionPlan:
    """The plan of a flat batch whose segments are already grouped by pass (a one-token
    prefill chunk belongs with the chunks, not the decode rows, whose tiles are counted).
    `local_groups`: what the local layers' passes list when it differs from `groups` (under
    pruning, the pruned rows read their window densely in local layers, and their global
    layers take the pruned path outside the plan). `shared`: the prefixes of `sizes.shared`'s
    pass (the global layers'; the local layers' is empty), whose rows' segments in `groups`
    skip them."""

    def tiling(shape: PassShape) -> dict:  # a pass's static sizes, as the builders take them
        return dict(
            page_size=sizes.page_size,
            q_tile=shape.q_tile,
            kv_tile=shape.kv_tile,
            num_tokens=num_tokens,
            max_tiles=shape.max_tiles,
            max_items=shape.max_items,
        )

    def passes(
        groups: Sequence[Sequence[Segment]], window: int, shared: Sequence[SharedPrefix]
    ) -> tuple[TilePass, ...]:
        built = tuple(
            build_pass(group, window=window, **tiling(shape))
            for group, shape in zip(groups, sizes.passes, strict=True)
        )
        if sizes.shared is None:
            if shared:
                raise ValueError("shared prefixes given to a plan without a shared pass")
            return built
        return (*built, build_shared_pass(shared, **tiling(sizes.shared)))

    return AttentionPlan(
        passes=passes(groups, 0, shared),
        chunk=sizes.chunk,
        backend=backend,
        local=passes(groups if local_groups is None else local_groups, window, ())
        if window > 0
        else None,
        window=window,
        shared=sizes.shared is not None,
    )


def padded_batch_plan(
    page_table: np.ndarray,
    starts: np.ndarray,
    num_valid: np.ndarray,
    tokens_per_row: int,
    page_size: int,
    window: int = 0,
) -> tuple[AttentionPlan, np.ndarray]:
    """The plan of a padded batch flattened row-major: row b holds `num_valid[b]` real tokens
    from position `starts[b]` in `tokens_per_row` slots and owns row b of `page_table` [B, P].
    Also returns each flat token's write page (the null page for padding). For teacher forcing,
    tests and benchmarks; the engine plans ragged batches directly. `window`: the model's
    sliding window (`ModelConfig.attention_window`), for its local layers' passes."""
    b, p = page_table.shape
    write_pages = np.zeros(b * tokens_per_row, np.int32)
    segments = []
    for row in range(b):
        n, first = int(num_valid[row]), int(starts[row])
        if n == 0:
            continue
        start = row * tokens_per_row
        positions = first + np.arange(n)
        write_pages[start : start + n] = page_table[row, positions // page_size]
        pages = page_table[row, : (first + n - 1) // page_size + 1]
        segments.append(Segment(start, n, first, first + n - 1, pages.tolist()))
    if tokens_per_row == 1:
        q_tile, kv_tile = 1, DECODE_KV_TILE
    elif tokens_per_row <= SHORT_PREFILL_Q_TILE:
        q_tile, kv_tile = SHORT_PREFILL_Q_TILE, SHORT_PREFILL_KV_TILE
    elif tokens_per_row < LONG_PREFILL_MIN_TOKENS:
        q_tile, kv_tile = PREFILL_Q_TILE, PREFILL_KV_TILE
    else:
        q_tile, kv_tile = LONG_PREFILL_Q_TILE, LONG_PREFILL_KV_TILE
    tiles = b * -(-tokens_per_row // q_tile)
    items = items_capacity(tiles * -(-p // kv_tile), CHUNK)
    sizes = PlanSizes(page_size, (PassShape(q_tile, kv_tile, tiles, items),))
    return plan_segments(segments, b * tokens_per_row, sizes, window=window), write_pages
