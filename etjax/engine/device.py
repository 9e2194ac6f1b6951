"""`DeviceBackend`: the engine's device half — the KV pool, resident rows, and a round's step.

The engine (engine.py) decides; this executes. Resident sequences each own a row of one
`DecodeState` store on device with `rows + 1` rows (the last is a never-active pad row). A round
runs one program (etjax/runtime/steps.py): `mixed`, one ragged step in which the decoding rows
each advance a token and prefill chunks of other sequences ride along in the same flat batch,
or `decode`, K steps of the rows in one scan when nothing is prefilling. Under pruning the
rows' tokens of either program read only the blocks their budgets keep, while a ragged step's
chunks attend densely (etjax/model/transformer.py). Every program gathers its
rows from the store and scatters them back itself. Page lists live on the host (the engine's)
and each call gets just the arrays its plan needs (etjax/attention/plan.py).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from etjax.attention import (
    PlanSizes,
    decode_sharing,
    kept_table_width,
    plan_decode,
    plan_passes,
    resolve_backend,
)
from etjax.attention.cascade import blocks_read_for_others, pruned_groups
from etjax.cache.kv_cache import copy_page, forget_row_mass, init_kv_cache
from etjax.cache.page_allocator import page_table_rows, pages_needed
from etjax.calibration.ramp import shifted_thresholds
from etjax.calibration.signal import identity_params, row_params
from etjax.constraints.matcher import ALL_TOKENS, initial_mask, mask_words
from etjax.distributed.mesh import make_mesh
from etjax.distributed.placement import Placement
from etjax.drafting import forced_draft_limit
from etjax.engine.backend import PrefillJob, RowInit
from etjax.entropy.cost import CostModel
from etjax.entropy.state import initial_entropy_state
from etjax.model.config import ModelConfig
from etjax.model.weights import Weights
from etjax.pruning.budget import kept_block_count
from etjax.pruning.groups import PrunedGroups
from etjax.runtime.buckets import (
    batch_bucket,
    next_power_of_two,
    pages_bucket,
    ragged_token_bucket,
)
from etjax.runtime.footprint import check_fits
from etjax.runtime.options import RuntimeOptions
from etjax.runtime.state import DecodeState, StepOutputs
from etjax.runtime.steps import (
    FlatBatch,
    StepStatics,
    decode_steps,
    mixed_step,
    put_rows,
    take_rows,
)
from etjax.sampling.sampler import initial_sampler_state
from etjax.sampling.settings import pack_sampler_params
from pallas_kernels.ragged_attention import Segment

# How many padded row-steps a drained batch may run in a larger row bucket it already has
# rather than compile its own (`DeviceBackend.burst_rows`). Measured on SmolLM2 (AMD EPYC, 2
# cores, benchmarks/burst_padding.py, docs/PERF.md): a padded row costs 0.05-0.18 of a one-row
# step, and compiling a decode burst (2.6-3.1 s) as long as 665-2,890 padded row-steps; below
# the smallest of those, padding never costs more than the compile it saves.
PADDED_ROW_STEPS = 512


class DeviceBackend:
    """The real device: SmolLM2 or any loaded model, on whatever JAX runs on."""

    def __init__(
        self,
        weights: Weights,
        cfg: ModelConfig,
        eos_ids: tuple[int, ...],
        options: RuntimeOptions,
        num_pages: int,
    ) -> None:
        self.cfg, self.options = cfg, options
        options.experts.check_model(cfg)  # FieldError: steering a model it cannot steer
        self.vocab_size = cfg.vocab_size  # token ids the engine accepts
        # The KV cache's dtype (None: the model's); "auto" resolves by platform here.
        self.kv_dtype = options.kv_cache_dtype(cfg.dtype)
        self.cost = CostModel.for_model(cfg, options.page_size, self.kv_dtype)
        self.num_pages = num_pages
        self.rows = options.resident_rows
        self.eos_ids = eos_ids or (-1,)
        shape = options.mesh_shape
        # One device: nothing is placed explicitly. A mesh: weights, pages and row state are
        # sharded once here, and every program keeps those shardings (etjax/distributed).
        self.placement = None if shape.size == 1 else Placement(make_mesh(shape))
        self.weights = weights
        # Before allocating anything.
        check_fits(cfg, num_pages, options.page_size, self.rows, kv_dtype=self.kv_dtype)
        # The longest page list a sequence can have: the model's context or the pool.
        self.max_seq_pages = min(
            pages_needed(cfg.max_position_embeddings, options.page_size), num_pages - 1
        )
        # Pruned steps take every row's whole page table at this one width (scoring loops
        # only up to the longest row), so their shapes do not follow context lengths.
        self.pruned_table_width = pages_bucket(self.max_seq_pages)
        # Pruning that ranks blocks by the mass they drew remembers it per store row (the pad
        # row included) and block of the pruned table; nothing else reads it.
        pruning = options.pruning
        by_mass = pruning.enabled and pruning.ranks_by_mass
        self.cache = init_kv_cache(
            cfg,
            num_pages,
            options.page_size,
            self.rows + 1 if by_mass else 1,
            self.pruned_table_width if by_mass else 1,
            self.kv_dtype,
        )
        self.store = _empty_store(cfg, self.rows + 1, self.eos_ids)
        if self.placement is not None:
            self.weights = self.placement.place_weights(weights)
            self.cache = self.placement.place_cache(self.cache)
            self.store = jax.device_put(
                self.store, self.placement.state(self.store, cfg.vocab_size)
            )
        # The entropy signal's calibration each inserted row gets (a traced [1] value: engines
        # with and without one share programs; etjax/calibration/signal.py).
        calibration = options.calibration
        self.calibration = row_params(1.0 if calibration is None else calibration.temperature)
        # Rows whose context is done: the logits of their last step [Sp, V] and their index.
        self._logits: dict[int, tuple[jax.Array, np.int32]] = {}
        self.prefill_rows = batch_bucket(options.max_prefill_rows)  # chunks per step, padded
        self._burst_buckets: set[int] = set()  # row buckets of the bursts run so far
        self._constrained: set[int] = set()  # rows whose requests have a grammar
        # The most tokens a row drafts: speculation's, or a constrained row's forced run.
        self.max_draft = forced_draft_limit(options.speculation, options.steps_per_sync)
        # The pruning's thresholds, traced (engines that differ only in them share the
        # programs) and on the device once; its shape is in the statics. Under a calibration
        # the ramp moves onto the calibrated scale by the shift fitted with it, so the setting
        # keeps the budget it was chosen for (etjax/calibration/ramp.py).
        thresholds = options.pruning.thresholds()
        if calibration is not None and calibration.ramp_shift:
            thresholds = shifted_thresholds(thresholds, calibration.ramp_shift)
        self.thresholds = jax.device_put(
            thresholds, None if self.placement is None else self.placement.replicated
        )
        self.attention_backend = resolve_backend(options.attention_backend, devices=shape.size)
        # What shapes the step programs (static); each call adds its rows' kept-table width.
        self.statics = StepStatics(
            cfg=cfg,
            cost=self.cost,
            pruning=options.pruning.shape(),
            placement=self.placement,
            attention_backend=self.attention_backend,
            experts=options.experts if options.experts.enabled else None,
        )

    # One ragged step ------------------------------------------------------------------------

    def mixed(
        self,
        rows: list[int],
        pages: list[list[int]],
        lengths: list[int],
        budgets: list[float],
        jobs: list[PrefillJob],
        drafts: list[list[int]] | None = None,
    ) -> tuple[StepOutputs, np.ndarray, list[tuple[float, float]], list[np.ndarray | None]]:
        """One step: each row of `rows` (with its pages, cached length and budget fraction)
        decodes one token, and each job appends its chunk. Returns the rows' outputs
        [steps, len(rows)], their budget fractions, the (FLOPs, bytes) of each job, and the
        log-probabilities of each job's `targets` (None without); a job's logits are kept
        for `insert`. Under pruning the rows read only their kept blocks.
        With speculation on, or forced tokens for constrained rows (etjax/drafting/forced.py),
        `drafts[j]` (at most `self.max_draft` tokens) run after row j's token and are
        verified; the outputs then have 1 + max_draft steps, emitted where committed."""
        opts, cfg = self.options, self.cfg
        spec = opts.speculation
        drafts = drafts or [[] for _ in rows]
        if len(rows) > opts.max_batch_size:
            raise ValueError(f"{len(rows)} decoding rows; max_batch_size={opts.max_batch_size}")
        if any(drafts) and not self.max_draft:
            raise ValueError("drafts given to an engine without speculation or forced tokens")
        if any(len(d) > self.max_draft for d in drafts):
            raise ValueError(f"a draft of more than max_draft={self.max_draft} tokens")
        # Speculation keeps one program per token bucket; forced drafts alone verify only in
        # the calls that have some.
        max_draft = self.max_draft if spec.enabled or any(drafts) else 0
        row_tokens = [1 + len(d) for d in drafts]
        total = sum(row_tokens) + sum(len(j.tokens) for j in jobs)
        if total > opts.token_budget:
            raise ValueError(f"a step of {total} tokens exceeds token_budget={opts.token_budget}")
        num_tokens = ragged_token_bucket(total)
        width = self.mixed_width(len(rows), bool(jobs))
        tokens = np.zeros(num_tokens, np.int32)
        positions = np.zeros(num_tokens, np.int32)
        write_pages = np.zeros(num_tokens, np.int32)  # padding writes to the null page
        index = np.full(width, self.rows, np.int32)  # pad rows: the never-active last row
        decode_slot = np.full(width, num_tokens, np.int32)  # out of range: dropped
        # A step without chunks computes no prefill logits (and plans no prefill passes).
        last_index = np.zeros(self.prefill_rows if jobs else 0, np.int32)
        draft_len = np.zeros(width, np.int32)
        targets = np.full(num_tokens, -1, np.int32)  # no prompt log-probabilities asked
        decoding, windowed, verifying, verifying_windows, chunks = [], [], [], [], []
        start = 0
        for j, (row, row_pages, n, draft) in enumerate(
            zip(rows, pages, lengths, drafts, strict=True)
        ):
            # The row's token (sampled on the device) at `start`, its drafts after it.
            m = 1 + len(draft)
            span = slice(start, start + m)
            index[j], decode_slot[j], draft_len[j] = row, start, len(draft)
            tokens[start + 1 : start + m] = draft
            positions[span] = n + np.arange(m)
            write_pages[span] = np.asarray(row_pages, np.int32)[positions[span] // opts.page_size]
            reach = n + m - 1
            segment = Segment(start, m, n, reach, row_pages[: reach // opts.page_size + 1])
            if opts.pruning.enabled:  # pruned: global layers outside the plan, local in it
                (verifying_windows if draft else windowed).append(segment)
            elif draft:
                verifying.append(segment)
            else:
                decoding.append(segment)
            start += m
        for j, job in enumerate(jobs):
            n = len(job.tokens)
            span = slice(start, start + n)
            tokens[span] = job.tokens
            positions[span] = job.start + np.arange(n)
            write_pages[span] = np.asarray(job.pages, np.int32)[positions[span] // opts.page_size]
            last_index[j] = start + n - 1
            if job.targets is not None:
                targets[span] = job.targets
            reach = job.start + n - 1
            chunks.append(
                Segment(start, n, job.start, reach, job.pages[: reach // opts.page_size + 1])
            )
            start += n
        decode_sizes, prefill_sizes = self._mixed_sizes(num_tokens, width)
        groups, passes = [decoding], decode_sizes.passes
        if max_draft:  # a row's token and drafts share one query tile
            groups, passes = [decoding, verifying], passes + self._verify_sizes(width).passes
        routed, prefill_passes = [], ()
        if jobs:
            routed, prefill_passes = prefill_sizes.route(chunks), prefill_sizes.passes
        plan = plan_passes(
            [*groups, *routed],
            num_tokens,
            PlanSizes(opts.page_size, passes + prefill_passes),
            self.attention_backend,
            cfg.attention_window,
            local_groups=[decoding + windowed, verifying + verifying_windows, *routed]
            if max_draft
            else [decoding + windowed, *routed],
        )
        batch = FlatBatch(
            tokens, positions, write_pages, decode_slot, last_index, draft_len, targets
        )
        table, max_kept = None, 0
        if opts.pruning.enabled:
            reach = [n + 1 + len(d) for n, d in zip(lengths, drafts, strict=True)]
            table, max_kept = self._pruned_tables(pages, reach, budgets, width)
        self.store, self.cache, out, logits, target_logprobs = mixed_step(
            self.weights,
            self.cache,
            self.store,
            index,
            batch,
            plan,
            table,
            self.thresholds,
            self._statics(rows, max_kept),
            max_draft,
        )
        for j, job in enumerate(jobs):
            self._logits[job.row] = (logits, np.int32(j))  # sliced inside the insert program
        asked = any(job.targets is not None for job in jobs)
        out, budget, target_logprobs = jax.device_get(
            (out, self.store.entropy.budget, target_logprobs if asked else None)
        )
        out = jax.tree.map(lambda x: x[:, : len(rows)], out)
        budget = np.asarray(budget)[index[: len(rows)]]
        spans, start = [], sum(row_tokens)
        for job in jobs:
            n = len(job.tokens)
            asks = job.targets is not None
            spans.append(np.asarray(target_logprobs[start : start + n]) if asks else None)
            start += n
        costs = [self._prefill_cost(job, len(jobs)) for job in jobs]
        return out, budget, costs, spans

    def mixed_width(self, num_rows: int, prefilling: bool) -> int:
        """Padded decoding rows of a ragged step. With chunks, `max_batch_size` (bucketed):
        the chunks dominate such a step, and one width keeps its programs to one per token
        bucket. Without (rows verifying drafts), the batch's own bucket, as a decode burst
        has: on a batch drained to a few rows, sampling and the LM head over 32 padded rows
        made a verifying step cost 4-5 burst steps (docs/PERF.md, "what a verifying step
        costs")."""
        return batch_bucket(self.options.max_batch_size if prefilling else num_rows)

    def _mixed_sizes(self, num_tokens: int, width: int) -> tuple[PlanSizes, PlanSizes]:
        # The decoding rows' pass and the chunks' passes of a step of `num_tokens` tokens.
        opts = self.options
        decode = self._decode_sizes(width)
        prefill = PlanSizes.prefill(
            num_tokens, self.prefill_rows, self.max_seq_pages, opts.page_size
        )
        return decode, prefill

    def _verify_sizes(self, width: int) -> PlanSizes:
        # Rows with drafts: one query tile of 1 + max_draft tokens (a power of two) each,
        # reading its pages once for all of them.
        tile = next_power_of_two(1 + self.max_draft)
        return self._decode_sizes(width, q_tile=tile)

    def _decode_sizes(self, rows: int, q_tile: int = 1, cascade: bool = False) -> PlanSizes:
        # A decode pass of `rows` rows; with the prefix cache, rows may hold the same pages,
        # so its capacity is per row rather than the pool's.
        opts = self.options
        return PlanSizes.decode(
            rows,
            self.num_pages,
            opts.page_size,
            q_tile,
            max_seq_pages=self.max_seq_pages,
            pages_shared=opts.prefix_cache,
            cascade=cascade,
        )

    def _prefill_cost(self, job: PrefillJob, num_jobs: int) -> tuple[float, float]:
        cost = self.cost
        keys = float(
            np.asarray(
                cost.keys_read(np.arange(job.start + 1, job.start + len(job.tokens) + 1), xp=np)
            ).sum()
        )
        flops = len(job.tokens) * cost.matmul_flops_per_token + cost.attention_flops_per_key * keys
        return flops, cost.weight_bytes / num_jobs + cost.kv_bytes_per_key * keys

    def insert(self, row: int, init: RowInit) -> None:
        """Make `row` the resident state of a sequence whose context was just prefilled."""
        logits, index = self._logits.pop(row)
        length = len(init.prompt) + len(init.generated)
        if self.cache.block_mass.shape[1] > 1:  # a new sequence remembers no block's mass
            self.cache = forget_row_mass(self.cache, np.int32(row))
        if init.grammar >= 0:
            self._constrained.add(row)
        if init.saved is None:
            in_prompt = np.zeros((1, self.cfg.vocab_size), bool)
            in_prompt[0, np.asarray(init.prompt, np.int64)] = True
            self.store = _insert_new_row(
                self.store,
                np.int32(row),
                logits,
                index,
                np.int32(length),
                pack_sampler_params([init.settings.sampler], 1, xp=np),
                np.int32(init.settings.max_new_tokens),
                np.bool_(not init.settings.ignore_eos),
                np.int32(init.settings.logprobs),
                self._first_mask(init.grammar),
                np.int32(init.grammar),
                in_prompt,
                np.float32(init.prefill_flops),
                np.float32(init.prefill_bytes),
                self.calibration,
            )
        else:
            self.store = _restore_row(
                self.store,
                np.int32(row),
                logits,
                index,
                np.int32(length),
                init.saved,
                np.float32(init.prefill_flops),
                np.float32(init.prefill_bytes),
            )

    def fork(self, source: int, row: int, pages: list[int], copy: tuple[int, int] | None) -> None:
        """See `Backend.fork`: the row's first logits are `source`'s, its partly filled last
        page a copy (keys, values and the pruning's key bounds)."""
        self._logits[row] = self._logits[source]
        if copy is not None:
            self.cache = copy_page(self.cache, np.int32(copy[0]), np.int32(copy[1]))

    def release(self, row: int) -> None:
        """Forget a row whose sequence finished or was preempted (its state is overwritten by
        the next `insert`; only prefill logits not yet inserted need dropping)."""
        self._logits.pop(row, None)
        self._constrained.discard(row)

    def _first_mask(self, grammar: int) -> np.ndarray:
        # [W] uint32 the tokens a new row may draw first: its grammar's, or all.
        if grammar < 0:
            return np.full(mask_words(self.cfg.vocab_size), ALL_TOKENS, np.uint32)
        return initial_mask(grammar)

    def _statics(self, rows: list[int], max_kept: int) -> StepStatics:
        # The call's statics: the engine's, its kept-table width, and how many rows are
        # constrained, rounded up to a power of two (0: none; a program of its own, which
        # only such calls pay for, masking that many rows).
        count = sum(row in self._constrained for row in rows)
        constrained = next_power_of_two(count) if count else 0
        return dataclasses.replace(self.statics, max_kept=max_kept, constrained=constrained)

    def save(self, row: int) -> DecodeState:
        """The row's state on the host, to restore after its KV is recomputed."""
        return jax.device_get(_save_row(self.store, np.int32(row)))

    # Decode -----------------------------------------------------------------------------

    def row_width(self, length: int, budget: float) -> int:
        """Blocks a row of `length` tokens with budget fraction `budget` reads in a burst: its
        pages, or under pruning the blocks its budget keeps (what pads a burst's tables)."""
        opts = self.options
        blocks = pages_needed(length + opts.steps_per_sync, opts.page_size)
        if not opts.pruning.enabled:
            return blocks
        return int(kept_block_count(np.float32(budget), blocks, opts.pruning, xp=np))

    def burst_bytes(self, lengths: list[int], budgets: list[float]) -> float:
        """Estimated bytes one step of a burst over these rows reads: the weights once, then
        dense, each row's own pages (the ragged attention reads no padding, so splitting a
        batch never pays); pruned, the kept blocks (each row's own count where the backend's
        kernel loops per row, else every padded row up to the largest count: the kernels stop
        there, not at the padded table's width), plus the per-page key bounds the selection
        scores (each row's own pages on the C++ scorer, else every padded row up to the
        longest row's pages)."""
        opts, cfg, cost, backend = self.options, self.cfg, self.cost, self.attention_backend
        pages = [pages_needed(n + opts.steps_per_sync, opts.page_size) for n in lengths]
        if not opts.pruning.enabled:
            return cost.weight_bytes + sum(pages) * opts.page_size * cost.kv_bytes_per_key
        num = batch_bucket(len(lengths))
        widths = [self.row_width(n, b) for n, b in zip(lengths, budgets, strict=True)]
        read = sum(widths) if backend.sparse_reads_own_count else num * max(widths)
        bounds = sum(pages) if backend.scores_own_pages else num * max(pages)
        scored = bounds * 2.0 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
        return cost.weight_bytes + read * opts.page_size * cost.kv_bytes_per_key + scored

    def decode(
        self,
        rows: list[int],
        pages: list[list[int]],
        lengths: list[int],
        budgets: list[float],
        tokens_left: int | None = None,
    ) -> tuple[StepOutputs, np.ndarray, np.ndarray]:
        """Run `steps_per_sync` steps on `rows`; returns the outputs [K, len(rows)], each
        row's budget fraction for its next step and the blocks per step its shared prefix
        spared it (`blocks_read_for_others`; host arrays). `tokens_left`: the most tokens a
        row may still produce, for the choice of the burst's row bucket (`burst_rows`)."""
        opts = self.options
        k, ps = opts.steps_per_sync, opts.page_size
        num = self.burst_rows(len(rows), tokens_left)
        index = np.full(num, self.rows, np.int32)  # pad rows: the never-active last row
        index[: len(rows)] = rows
        max_kept, plan, spared = 0, None, np.zeros(len(rows), np.float32)
        groups = None
        segments = [
            Segment(j, 1, n, n + k - 1, p[: pages_needed(n + k, ps)])
            for j, (n, p) in enumerate(zip(lengths, pages, strict=True))
        ]
        window = self.cfg.attention_window
        # Dense bursts read the rows' shared prefixes once (etjax/attention/cascade.py).
        cascade = (
            opts.prefix_cache
            and not opts.pruning.enabled
            and self.attention_backend.reads_shared_prefixes
        )
        sizes = self._decode_sizes(num, cascade=cascade)
        if opts.pruning.enabled:
            table, max_kept = self._pruned_tables(pages, [n + k for n in lengths], budgets, num)
            base = np.zeros(num, np.int32)
            if window:  # the local layers read each row's window densely, through a plan
                plan = plan_passes(
                    [[]], num, sizes, self.attention_backend, window, local_groups=[segments]
                )
            # Rows sharing a prefix select its blocks together and read them once.
            if (
                opts.pruning.group_shared_prefixes
                and opts.prefix_cache
                and self.attention_backend.reads_grouped_pruned_rows
            ):
                found = pruned_groups(segments, ps, num)
                if found is not None:
                    groups = PrunedGroups(*(jnp.asarray(x) for x in found))
        else:
            # Dense: writes need only the pages the burst's positions fall in, and attention
            # reads each row's own pages up to its length after the burst.
            width = (k - 1) // ps + 2
            base = np.zeros(num, np.int32)
            base[: len(rows)] = [n // ps for n in lengths]
            table = page_table_rows(
                [p[b : b + width] for p, b in zip(pages, base, strict=False)]
                + [[]] * (num - len(rows)),
                width,
            )
            sharing = decode_sharing(segments, sizes)
            plan = plan_decode(segments, num, sizes, self.attention_backend, window, sharing)
            spared = blocks_read_for_others(sharing[1], num)[: len(rows)]
        self.store, self.cache, out = decode_steps(
            self.weights,
            self.cache,
            self.store,
            index,
            table,
            base,
            plan,
            self.thresholds,
            self._statics(rows, max_kept),
            k,
            groups,
        )
        out, budget = jax.device_get((out, self.store.entropy.budget))
        out = jax.tree.map(lambda x: x[:, : len(rows)], out)
        if out.spared_blocks is not None:  # per step: the groups' counts follow the budgets
            spared = out.spared_blocks
        return out, np.asarray(budget)[index[: len(rows)]], spared

    def burst_rows(self, num_rows: int, tokens_left: int | None) -> int:
        """The padded rows of a burst over `num_rows` rows: their own bucket, or, when the
        batch has drained below the buckets this backend already runs and few tokens are left,
        the smallest of those that holds them. A new bucket is a new program, and compiling
        it (seconds) costs more than the padded rows of a short tail (`PADDED_ROW_STEPS`)."""
        own = batch_bucket(num_rows)
        larger = [b for b in self._burst_buckets if b > own]
        if own not in self._burst_buckets and larger and tokens_left is not None:
            padded = min(larger)
            if (padded - num_rows) * tokens_left <= PADDED_ROW_STEPS:
                own = padded
        self._burst_buckets.add(own)
        return own

    def _pruned_tables(
        self, pages: list[list[int]], reach: list[int], budgets: list[float], num: int
    ) -> tuple[np.ndarray, int]:
        # A pruned step's whole page tables [num, W] (the block selection scores every page of
        # a row) and the static width of the kept table for the largest budget, given each
        # row's length after the step (`reach`).
        opts, ps, width = self.options, self.options.page_size, self.pruned_table_width
        table = page_table_rows([p[:width] for p in pages] + [[]] * (num - len(pages)), width)
        blocks = np.array([pages_needed(r, ps) for r in reach], np.int64)
        needed = kept_block_count(np.asarray(budgets, np.float32), blocks, opts.pruning, xp=np)
        return table, kept_table_width(self.attention_backend, int(needed.max(initial=1)), width)


@functools.partial(jax.jit, donate_argnums=0)
def _insert_new_row(
    store,
    row,
    logits,
    index,
    length,
    params,
    max_new_tokens,
    stop_on_eos,
    logprobs,
    allowed,
    grammar,
    in_prompt,
    flops,
    nbytes,
    calibration,
) -> DecodeState:
    # A fresh row: the request's sampler, no output yet, the prefill's cost counted. logits:
    # [Sp, V] of the step that finished its context, row `index` its own.
    one = DecodeState(
        logits=logits[index][None],
        lengths=length[None],
        page_table=None,
        active=jnp.ones(1, bool),
        num_generated=jnp.zeros(1, jnp.int32),
        max_new_tokens=max_new_tokens[None],
        stop_on_eos=stop_on_eos[None],
        eos_ids=None,
        token_counts=jnp.zeros((1, store.token_counts.shape[1]), jnp.int32),
        in_prompt=in_prompt,
        logprobs=logprobs[None],
        allowed=allowed[None],
        grammar=grammar[None],
        sampler=params,
        sampler_state=initial_sampler_state(params),
        entropy=initial_entropy_state(flops[None], nbytes[None]),
        calibration=calibration,
    )
    return put_rows(store, row[None], one)


@functools.partial(jax.jit, donate_argnums=0)
def _restore_row(store, row, logits, index, length, saved, flops, nbytes) -> DecodeState:
    # A preempted row back: its saved state, the recomputed prefill's cost added.
    entropy = saved.entropy
    one = saved.replace(
        logits=logits[index][None],
        lengths=length[None],
        entropy=entropy.replace(
            cost_flops=entropy.cost_flops + flops, cost_bytes=entropy.cost_bytes + nbytes
        ),
    )
    return put_rows(store, row[None], one)


@jax.jit
def _save_row(store: DecodeState, row: jax.Array) -> DecodeState:
    one = take_rows(store, row[None])
    return one.replace(logits=None, lengths=None, eos_ids=None)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _empty_store(cfg: ModelConfig, rows: int, eos_ids: tuple[int, ...]) -> DecodeState:
    # One program (eager zeros would compile one small program per shape and dtype).
    params = pack_sampler_params([], rows)
    zeros = np.zeros(rows, np.float32)
    return DecodeState(
        logits=jnp.zeros((rows, cfg.vocab_size), jnp.float32),
        lengths=jnp.zeros(rows, jnp.int32),
        page_table=jnp.zeros((rows, 1), jnp.int32),
        active=jnp.zeros(rows, bool),
        num_generated=jnp.zeros(rows, jnp.int32),
        max_new_tokens=jnp.zeros(rows, jnp.int32),
        stop_on_eos=jnp.zeros(rows, bool),
        eos_ids=jnp.asarray(eos_ids, jnp.int32),
        token_counts=jnp.zeros((rows, cfg.vocab_size), jnp.int32),
        in_prompt=jnp.zeros((rows, cfg.vocab_size), bool),
        logprobs=jnp.zeros(rows, jnp.int32),
        allowed=jnp.full((rows, mask_words(cfg.vocab_size)), ALL_TOKENS, jnp.uint32),
        grammar=jnp.full(rows, -1, jnp.int32),
        sampler=params,
        sampler_state=initial_sampler_state(params),
        entropy=initial_entropy_state(jnp.asarray(zeros), jnp.asarray(zeros.copy())),
        calibration=identity_params(rows),
    )
