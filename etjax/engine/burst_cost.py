"""`BurstCost`: what one step of a decode burst reads, estimated on the host for the grouping
(grouping.py `split_by_width` cuts a batch where that reads fewer bytes).

Built once per engine from its `CostModel` (etjax/entropy/cost.py: the bytes of the weights,
of a cached key, of a page's key bounds) and the layout's fixed sizes (`StepGeometry`), so it
mirrors the shapes `burst_inputs` gives a burst. The engine asks it through its backend
(`Backend.burst_cost`); a test double brings its own.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from etjax.buckets import batch_bucket
from etjax.cache.page_allocator import pages_needed
from etjax.engine.step_inputs import StepGeometry
from etjax.entropy.cost import CostModel
from etjax.pruning.budget import kept_block_count


@dataclasses.dataclass(frozen=True)
class BurstCost:
    """The bytes a burst's step reads, from the engine's cost model and geometry."""

    cost: CostModel
    geometry: StepGeometry

    def row_width(self, length: int, budget: float) -> int:
        """Blocks a row of `length` tokens with budget fraction `budget` reads in a burst: its
        pages, or under pruning the blocks its budget keeps (what pads a burst's tables)."""
        g = self.geometry
        blocks = pages_needed(length + g.steps_per_sync, g.page_size)
        if not g.backend.prunes:
            return blocks
        return int(kept_block_count(np.float32(budget), blocks, g.pruning, xp=np))

    def burst_bytes(self, lengths: list[int], budgets: list[float]) -> float:
        """Estimated bytes one step of a burst over rows of these `lengths` and `budgets`
        reads: the weights once, then dense, each row's own pages (the ragged attention reads
        no padding, so splitting a batch never pays); pruned, the kept blocks (each row's own
        count where the backend's kernel loops per row, else every padded row up to the
        largest count: the kernels stop there, not at the padded table's width), plus the
        per-page key bounds the selection scores (each row's own pages on the C++ scorer,
        else every padded row up to the longest row's pages)."""
        g, cost, backend = self.geometry, self.cost, self.geometry.backend
        pages = [pages_needed(n + g.steps_per_sync, g.page_size) for n in lengths]
        key_bytes = g.page_size * cost.kv_bytes_per_key  # a whole page of keys and values
        if not backend.prunes:
            return cost.weight_bytes + sum(pages) * key_bytes
        num = batch_bucket(len(lengths))
        widths = [self.row_width(n, b) for n, b in zip(lengths, budgets, strict=True)]
        read = sum(widths) if backend.sparse_reads_own_count else num * max(widths)
        bounds = sum(pages) if backend.scores_own_pages else num * max(pages)
        return cost.weight_bytes + read * key_bytes + bounds * cost.bound_bytes_per_page
