"""A step's inputs as data: what the device programs take, built on the host from a round's
decision.

The engine decides which rows decode, which chunks prefill and what each row drafts; the
functions here turn that into the arrays of one program call (the flat ragged batch, its
attention plan, the pruned page tables) without running anything on a device, so the layout
can be tested by hand. `DeviceBackend` (device.py) only calls them and runs the program.

- `StepGeometry`: the engine's fixed sizes a layout depends on, made once per engine.
- `mixed_inputs`: one ragged step (`etjax/runtime/steps.py` `mixed_step`): each row's token,
  then its drafts, then every prefill chunk, in one flat batch.
- `burst_inputs`: K decode steps of the rows in one scan (`decode_steps`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from etjax.attention import (
    AttentionBackend,
    AttentionPlan,
    PlanSizes,
    decode_sharing,
    kept_table_width,
    plan_decode,
    plan_passes,
)
from etjax.attention.cascade import blocks_read_for_others, pruned_groups
from etjax.buckets import (
    batch_bucket,
    next_power_of_two,
    pages_bucket,
    ragged_token_bucket,
)
from etjax.cache.page_allocator import page_table_rows, pages_needed
from etjax.drafting.costs import verify_token_bucket
from etjax.engine.backend import PrefillJob
from etjax.model.config import ModelConfig
from etjax.pruning.budget import kept_block_count
from etjax.pruning.config import PruningConfig
from etjax.runtime.options import RuntimeOptions
from etjax.runtime.steps import FlatBatch
from pallas_kernels.ragged_attention import Segment


@dataclasses.dataclass(frozen=True)
class StepGeometry:
    """The sizes a step's layout follows that are fixed for an engine's life."""

    page_size: int
    pad_row: int  # the store's never-active row, which padding rows point at
    num_pages: int  # the KV pool, null page included
    max_seq_pages: int  # the longest page list a sequence can have
    pruned_table_width: int  # every pruned row's whole page table, at one width
    prefill_rows: int  # prefill chunks per step, padded
    max_batch_size: int
    token_budget: int
    steps_per_sync: int  # decode steps in one burst
    max_draft: int  # the most tokens a row drafts (speculation or forced tokens); 0: none
    prefix_cache: bool  # rows may hold the same pages
    pruning: PruningConfig  # its numbers, for the kept tables' widths
    backend: AttentionBackend  # the kernels, and whether rows prune (`backend.prunes`)
    window: int  # the model's sliding window (0: none)

    def __post_init__(self) -> None:
        if self.pruning.enabled != self.backend.prunes:
            raise ValueError(
                f"pruning.enabled={self.pruning.enabled} with a backend that "
                f"{'prunes' if self.backend.prunes else 'does not prune'}: resolve the "
                "backend with the pruning's shape (resolve_backend(..., pruning=...))"
            )

    @classmethod
    def for_engine(
        cls,
        cfg: ModelConfig,
        options: RuntimeOptions,
        num_pages: int,
        backend: AttentionBackend,
        max_draft: int,
    ) -> StepGeometry:
        """The geometry of an engine of `cfg` with `options` over a pool of `num_pages`."""
        # The longest page list a sequence can have: the engine's context or the pool.
        context = options.context_limit(cfg.max_position_embeddings)
        max_seq_pages = min(pages_needed(context, options.page_size), num_pages - 1)
        return cls(
            page_size=options.page_size,
            pad_row=options.resident_rows,
            num_pages=num_pages,
            max_seq_pages=max_seq_pages,
            # Pruned steps take every row's whole page table at this one width (scoring loops
            # only up to the longest row), so their shapes do not follow context lengths.
            pruned_table_width=pages_bucket(max_seq_pages),
            prefill_rows=batch_bucket(options.max_prefill_rows),
            max_batch_size=options.max_batch_size,
            token_budget=options.token_budget,
            steps_per_sync=options.steps_per_sync,
            max_draft=max_draft,
            prefix_cache=options.prefix_cache,
            pruning=options.pruning,
            backend=backend,
            window=cfg.attention_window,
        )

    def mixed_width(self, num_rows: int, prefilling: bool) -> int:
        """Padded decoding rows of a ragged step. With chunks, `max_batch_size` (bucketed):
        the chunks dominate such a step, and one width keeps its programs to one per token
        bucket. Without (rows verifying drafts), the batch's own bucket, as a decode burst
        has: on a batch drained to a few rows, sampling and the LM head over 32 padded rows
        made a verifying step cost 4-5 burst steps (docs/PERF.md, "what a verifying step
        costs")."""
        return batch_bucket(self.max_batch_size if prefilling else num_rows)

    def decode_sizes(self, rows: int, q_tile: int = 1, cascade: bool = False) -> PlanSizes:
        """A decode pass of `rows` rows; with the prefix cache, rows may hold the same pages,
        so its capacity is per row rather than the pool's."""
        return PlanSizes.decode(
            rows,
            self.num_pages,
            self.page_size,
            q_tile,
            max_seq_pages=self.max_seq_pages,
            pages_shared=self.prefix_cache,
            cascade=cascade,
        )

    def verify_sizes(self, width: int, max_draft: int | None = None) -> PlanSizes:
        """Rows with drafts: one query tile of 1 + max_draft tokens (a power of two; the
        step's own `max_draft` where it checks fewer than the engine's) each, reading its
        pages once for all of them."""
        drafts = self.max_draft if max_draft is None else max_draft
        return self.decode_sizes(width, q_tile=next_power_of_two(1 + drafts))

    def prefill_sizes(self, num_tokens: int) -> PlanSizes:
        """The chunks' passes of a step of `num_tokens` tokens."""
        return PlanSizes.prefill(num_tokens, self.prefill_rows, self.max_seq_pages, self.page_size)

    def pruned_tables(
        self, pages: list[list[int]], reach: list[int], budgets: list[float], num: int
    ) -> tuple[np.ndarray, int]:
        """A pruned step's whole page tables [num, W] (the block selection scores every page
        of a row) and the static width of the kept table for the largest budget, given each
        row's length after the step (`reach`)."""
        width = self.pruned_table_width
        table = page_table_rows([p[:width] for p in pages] + [[]] * (num - len(pages)), width)
        blocks = np.array([pages_needed(r, self.page_size) for r in reach], np.int64)
        needed = kept_block_count(np.asarray(budgets, np.float32), blocks, self.pruning, xp=np)
        return table, kept_table_width(self.backend, int(needed.max(initial=1)), width)


@dataclasses.dataclass(frozen=True)
class MixedInputs:
    """One ragged step's arguments. Bm = padded decoding rows, W = pruned table width."""

    rows: np.ndarray  # [Bm] int32 store rows; the pad row for padding
    batch: FlatBatch
    plan: AttentionPlan
    page_table: np.ndarray | None  # [Bm, W] int32 under pruning, else None
    max_kept: int  # under pruning, the kept table's static width
    max_draft: int  # the program's draft slots per row (0: a step that verifies nothing)
    row_tokens: int  # flat slots the rows' tokens and drafts take, before the chunks


def mixed_inputs(
    geometry: StepGeometry,
    rows: list[int],
    pages: list[list[int]],
    lengths: list[int],
    budgets: list[float],
    jobs: list[PrefillJob],
    drafts: list[list[int]],
    speculating: bool,
) -> MixedInputs:
    """Lay out one ragged step: row j's token at its slot, its `drafts[j]` after it, then each
    job's chunk; positions, the pages each token writes, the attention plan and, under
    pruning, the rows' page tables. `speculating`: the engine verifies drafts in every such
    step with decoding rows (one program per token bucket), else only in the steps that have
    some. Raises ValueError where the engine broke a limit it was built with."""
    g = geometry
    _check_mixed(g, rows, drafts, jobs)
    # A step of prompt chunks alone has no row to verify: its program has no draft slots,
    # whose logits (padded rows x 1 + max_draft, each over the vocabulary) would cost a
    # batch-1 request's prefill about a third of a decode step on a 2-core CPU.
    max_draft = g.max_draft if rows and (speculating or any(drafts)) else 0
    row_tokens = sum(1 + len(d) for d in drafts)
    num_tokens = ragged_token_bucket(row_tokens + sum(len(j.tokens) for j in jobs))
    if any(drafts) and not jobs:
        # A verifying step alone pads to its own bucket (2, 4, 8, ... tokens) and checks as
        # many drafts per row as its slots hold: a lone row drafting 3 tokens runs 4 slots.
        num_tokens = verify_token_bucket(row_tokens)
        max_draft = min(max_draft, num_tokens - 1)
    width = g.mixed_width(len(rows), bool(jobs))
    flat = _FlatLayout(g, num_tokens, width, bool(jobs))
    for row, row_pages, n, draft in zip(rows, pages, lengths, drafts, strict=True):
        flat.add_row(row, row_pages, n, draft)
    for job in jobs:
        flat.add_chunk(job)
    plan = _mixed_plan(g, flat, num_tokens, width, max_draft, bool(jobs))
    table, max_kept = None, 0
    if g.backend.prunes:
        reach = [n + 1 + len(d) for n, d in zip(lengths, drafts, strict=True)]
        table, max_kept = g.pruned_tables(pages, reach, budgets, width)
    return MixedInputs(flat.index, flat.batch(), plan, table, max_kept, max_draft, row_tokens)


def _check_mixed(
    g: StepGeometry, rows: list[int], drafts: list[list[int]], jobs: list[PrefillJob]
) -> None:
    if len(rows) > g.max_batch_size:
        raise ValueError(f"{len(rows)} decoding rows; max_batch_size={g.max_batch_size}")
    if any(drafts) and not g.max_draft:
        raise ValueError("drafts given to an engine without speculation or forced tokens")
    if any(len(d) > g.max_draft for d in drafts):
        raise ValueError(f"a draft of more than max_draft={g.max_draft} tokens")
    total = sum(1 + len(d) for d in drafts) + sum(len(j.tokens) for j in jobs)
    if total > g.token_budget:
        raise ValueError(f"a step of {total} tokens exceeds token_budget={g.token_budget}")


class _FlatLayout:
    """The flat batch of a ragged step as it is filled: rows first, then chunks, each taking
    the next slots; and each one's attention segment, by the pass group it belongs to."""

    def __init__(self, g: StepGeometry, num_tokens: int, width: int, prefilling: bool) -> None:
        self.page_size, self.pruned = g.page_size, g.backend.prunes
        self.tokens = np.zeros(num_tokens, np.int32)
        self.positions = np.zeros(num_tokens, np.int32)
        self.write_pages = np.zeros(num_tokens, np.int32)  # padding writes to the null page
        self.index = np.full(width, g.pad_row, np.int32)
        self.decode_slot = np.full(width, num_tokens, np.int32)  # out of range: dropped
        # A step without chunks computes no prefill logits (and plans no prefill passes).
        self.last_index = np.zeros(g.prefill_rows if prefilling else 0, np.int32)
        self.draft_len = np.zeros(width, np.int32)
        self.targets = np.full(num_tokens, -1, np.int32)  # no prompt log-probabilities asked
        self.decoding: list[Segment] = []  # dense rows without drafts
        self.verifying: list[Segment] = []  # dense rows with drafts
        self.windowed: list[Segment] = []  # pruned rows (their local layers only)
        self.verifying_windows: list[Segment] = []  # pruned rows with drafts
        self.chunks: list[Segment] = []
        self.start = 0  # the next free slot
        self.rows = 0

    def _place(self, tokens, first: int, pages: list[int]) -> Segment:
        # `tokens` at the next slots from position `first`, on `pages`.
        m, start = len(tokens), self.start
        span = slice(start, start + m)
        self.tokens[span] = tokens
        self.positions[span] = first + np.arange(m)
        self.write_pages[span] = np.asarray(pages, np.int32)[self.positions[span] // self.page_size]
        self.start += m
        reach = first + m - 1
        return Segment(start, m, first, reach, pages[: reach // self.page_size + 1])

    def add_row(self, row: int, pages: list[int], length: int, draft: list[int]) -> None:
        # The row's token (sampled on the device, 0 here) at its slot, its drafts after it.
        j = self.rows
        self.index[j], self.decode_slot[j], self.draft_len[j] = row, self.start, len(draft)
        segment = self._place([0, *draft], length, pages)
        if self.pruned:  # pruned: global layers outside the plan, local in it
            (self.verifying_windows if draft else self.windowed).append(segment)
        else:
            (self.verifying if draft else self.decoding).append(segment)
        self.rows += 1

    def add_chunk(self, job: PrefillJob) -> None:
        start = self.start
        segment = self._place(job.tokens, job.start, job.pages)
        self.last_index[len(self.chunks)] = self.start - 1
        if job.targets is not None:
            self.targets[start : self.start] = job.targets
        self.chunks.append(segment)

    def batch(self) -> FlatBatch:
        return FlatBatch(
            self.tokens,
            self.positions,
            self.write_pages,
            self.decode_slot,
            self.last_index,
            self.draft_len,
            self.targets,
        )


def _mixed_plan(
    g: StepGeometry, flat: _FlatLayout, num_tokens: int, width: int, max_draft: int, jobs: bool
) -> AttentionPlan:
    # The rows' pass (and, verifying, one query tile of a row's token and drafts), then the
    # chunks' passes by length; a model's local layers also read the pruned rows' windows.
    groups, passes = [flat.decoding], g.decode_sizes(width).passes
    local_groups = [flat.decoding + flat.windowed]
    if max_draft:
        verify = g.verify_sizes(width, max_draft).passes
        groups, passes = [flat.decoding, flat.verifying], passes + verify
        local_groups.append(flat.verifying + flat.verifying_windows)
    routed, prefill_passes = [], ()
    if jobs:
        prefill = g.prefill_sizes(num_tokens)
        routed, prefill_passes = prefill.route(flat.chunks), prefill.passes
    return plan_passes(
        [*groups, *routed],
        num_tokens,
        PlanSizes(g.page_size, passes + prefill_passes),
        g.backend,
        g.window,
        local_groups=[*local_groups, *routed],
    )


@dataclasses.dataclass(frozen=True)
class BurstInputs:
    """A decode burst's arguments. B = padded rows, W = table width."""

    rows: np.ndarray  # [B] int32 store rows; the pad row for padding
    page_table: np.ndarray  # [B, W] int32: pruned, whole tables; dense, the pages written
    page_base: np.ndarray  # [B] int32 logical page of each table's first column
    plan: AttentionPlan | None  # dense work (None under pruning without local layers)
    max_kept: int  # under pruning, the kept table's static width
    # Under pruning, rows sharing a prefix that select its blocks together, as host arrays
    # (etjax/attention/cascade.py `pruned_groups`), or None.
    groups: tuple[np.ndarray, ...] | None
    spared: np.ndarray  # [len(rows)] float32 blocks per step read once for a row's group


def burst_inputs(
    geometry: StepGeometry,
    rows: list[int],
    pages: list[list[int]],
    lengths: list[int],
    budgets: list[float],
    num: int,
) -> BurstInputs:
    """Lay out a burst of `steps_per_sync` decode steps over `rows`, padded to `num` rows."""
    g = geometry
    k, ps = g.steps_per_sync, g.page_size
    index = np.full(num, g.pad_row, np.int32)
    index[: len(rows)] = rows
    spared = np.zeros(len(rows), np.float32)
    segments = [
        Segment(j, 1, n, n + k - 1, p[: pages_needed(n + k, ps)])
        for j, (n, p) in enumerate(zip(lengths, pages, strict=True))
    ]
    base = np.zeros(num, np.int32)
    if g.backend.prunes:
        sizes = g.decode_sizes(num)
        table, max_kept = g.pruned_tables(pages, [n + k for n in lengths], budgets, num)
        plan = None
        if g.window:  # the local layers read each row's window densely, through a plan
            plan = plan_passes([[]], num, sizes, g.backend, g.window, local_groups=[segments])
        groups = None
        # Rows sharing a prefix select its blocks together and read them once.
        if (
            g.pruning.group_shared_prefixes
            and g.prefix_cache
            and g.backend.reads_grouped_pruned_rows
        ):
            groups = pruned_groups(segments, ps, num)
        return BurstInputs(index, table, base, plan, max_kept, groups, spared)
    # Dense bursts read the rows' shared prefixes once (etjax/attention/cascade.py).
    sizes = g.decode_sizes(num, cascade=g.prefix_cache and g.backend.reads_shared_prefixes)
    # Writes need only the pages the burst's positions fall in, and attention reads each
    # row's own pages up to its length after the burst.
    width = (k - 1) // ps + 2
    base[: len(rows)] = [n // ps for n in lengths]
    table = page_table_rows(
        [p[b : b + width] for p, b in zip(pages, base, strict=False)] + [[]] * (num - len(rows)),
        width,
    )
    sharing = decode_sharing(segments, sizes)
    plan = plan_decode(segments, num, sizes, g.backend, g.window, sharing)
    spared = blocks_read_for_others(sharing[1], num)[: len(rows)]
    return BurstInputs(index, table, base, plan, 0, None, spared)
