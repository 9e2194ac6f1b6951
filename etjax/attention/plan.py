"""`AttentionPlan`: what the tokens of one device step attend to, built on the host.

A step's tokens come from sequences (`Segment`s of a flat batch). The plan routes each segment
to a pass by its number of new tokens: decode tokens go to a pass of one-token query tiles,
prefill chunks to a pass of wide tiles, so a decode row never pads to a chunk's shape. Each pass
lists (query tile, key tile) work items over the sequence's own pages only, up to each tile's
last position (pallas_kernels/ragged_attention/work_items.py).

Shapes come from `PlanSizes`, fixed by the engine's sizes and the step's token bucket, never by
context lengths: a new mix of lengths reuses the compiled step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import flax.struct
import numpy as np

from pallas_kernels.ragged_attention.work_items import (
    Segment,
    TilePass,
    build_pass,
    items_capacity,
)

# Tiling, chosen by timing the XLA backend on this 2-core CPU (SmolLM2's 9 heads, 3 KV heads,
# head_dim 64, pages of 16; medians of warm calls, 2026-11-30): 16 items per loop trip; decode
# tokens against key tiles of 4 pages; prefill tiles of 64 queries against 4 pages. Per layer,
# 8 rows of 8 pages took 0.32 ms (the padded gather it replaced: 0.30 ms) and 32 rows of
# 128 pages 22 ms (57 ms); a 512-token chunk after 3584 cached tokens 103 ms (173 ms). Larger
# trips waste more of the last one on short rows (chunk 64: 0.69 ms for the 8 x 8 case). A
# tile-major layout for prefill (a trip's items all of one tile, scored as one 512-key block,
# only that tile's accumulator touched) measured slower: 111-189 ms against 97 ms.
CHUNK = 16
DECODE_KV_TILE = 4
PREFILL_Q_TILE = 64
PREFILL_KV_TILE = 4


@dataclass(frozen=True)
class PassShape:
    """Static tiling of one pass: tiles of q_tile tokens, items of kv_tile pages."""

    q_tile: int
    kv_tile: int
    max_tiles: int
    max_items: int


@dataclass(frozen=True)
class PlanSizes:
    """The static shapes of a step's plan: its passes, in routing order (a segment goes to
    the first pass whose q_tile holds its tokens, else to the last)."""

    page_size: int
    passes: tuple[PassShape, ...]
    chunk: int = CHUNK

    @staticmethod
    def decode(rows: int, num_pages: int, page_size: int) -> PlanSizes:
        """One token per row of `rows`, over a pool of `num_pages` pages: the rows' pages are
        disjoint, so their items number at most num_pages / kv_tile + rows."""
        items = items_capacity(num_pages // DECODE_KV_TILE + rows, CHUNK)
        return PlanSizes(page_size, (PassShape(1, DECODE_KV_TILE, rows, items),))

    @staticmethod
    def prefill(num_tokens: int, rows: int, max_seq_pages: int, page_size: int) -> PlanSizes:
        """Chunks of up to `rows` sequences holding `num_tokens` tokens in all, each sequence
        at most `max_seq_pages` pages long."""
        tiles = num_tokens // PREFILL_Q_TILE + rows
        items = items_capacity(tiles * (-(-max_seq_pages // PREFILL_KV_TILE)), CHUNK)
        shape = PassShape(PREFILL_Q_TILE, PREFILL_KV_TILE, tiles, items)
        return PlanSizes(page_size, (shape,))


@flax.struct.dataclass
class AttentionPlan:
    """A step's attention work as arrays (see the module docstring)."""

    passes: tuple[TilePass, ...]
    chunk: int = flax.struct.field(pytree_node=False, default=CHUNK)
    # The kernels that run it (etjax/attention/seam.py): "xla", "pallas_tpu" or "pallas_gpu".
    backend: str = flax.struct.field(pytree_node=False, default="xla")


def plan_segments(
    segments: Sequence[Segment], num_tokens: int, sizes: PlanSizes, backend: str = "xla"
) -> AttentionPlan:
    """The plan of a flat batch of `num_tokens` tokens holding `segments` (host arrays), each
    routed by length: to the first pass whose q_tile holds its tokens, else to the last; run by
    `backend`'s kernels."""
    routed: list[list[Segment]] = [[] for _ in sizes.passes]
    for seg in segments:
        index = next(
            (i for i, p in enumerate(sizes.passes) if seg.num_tokens <= p.q_tile),
            len(sizes.passes) - 1,
        )
        routed[index].append(seg)
    return plan_passes(routed, num_tokens, sizes, backend)


def plan_passes(
    groups: Sequence[Sequence[Segment]], num_tokens: int, sizes: PlanSizes, backend: str = "xla"
) -> AttentionPlan:
    """The plan of a flat batch whose segments are already grouped by pass (a one-token
    prefill chunk belongs with the chunks, not the decode rows, whose tiles are counted)."""
    passes = tuple(
        build_pass(
            group,
            page_size=sizes.page_size,
            q_tile=shape.q_tile,
            kv_tile=shape.kv_tile,
            num_tokens=num_tokens,
            max_tiles=shape.max_tiles,
            max_items=shape.max_items,
        )
        for group, shape in zip(groups, sizes.passes, strict=True)
    )
    return AttentionPlan(passes=passes, chunk=sizes.chunk, backend=backend)


def padded_batch_plan(
    page_table: np.ndarray,
    starts: np.ndarray,
    num_valid: np.ndarray,
    tokens_per_row: int,
    page_size: int,
) -> tuple[AttentionPlan, np.ndarray]:
    """The plan of a padded batch flattened row-major: row b holds `num_valid[b]` real tokens
    from position `starts[b]` in `tokens_per_row` slots and owns row b of `page_table` [B, P].
    Also returns each flat token's write page (the null page for padding). For teacher forcing,
    tests and benchmarks; the engine plans ragged batches directly."""
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
    q_tile, kv_tile = (
        (1, DECODE_KV_TILE)
        if tokens_per_row == 1
        else (
            PREFILL_Q_TILE,
            PREFILL_KV_TILE,
        )
    )
    tiles = b * -(-tokens_per_row // q_tile)
    items = items_capacity(tiles * -(-p // kv_tile), CHUNK)
    sizes = PlanSizes(page_size, (PassShape(q_tile, kv_tile, tiles, items),))
    return plan_segments(segments, b * tokens_per_row, sizes), write_pages
