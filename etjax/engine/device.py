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
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from etjax.attention import resolve_backend
from etjax.buckets import batch_bucket, next_power_of_two
from etjax.cache import spare_pool
from etjax.cache.kv_cache import copy_page, forget_row_mass, init_kv_cache
from etjax.calibration.ramp import shifted_thresholds
from etjax.calibration.signal import row_params
from etjax.constraints.matcher import ALL_TOKENS, initial_mask, mask_words
from etjax.distributed.mesh import make_mesh
from etjax.distributed.placement import Placement
from etjax.drafting import forced_draft_limit
from etjax.engine.backend import RowInit
from etjax.engine.burst_cost import BurstCost
from etjax.engine.row_store import (
    empty_store,
    new_row,
    new_row_state,
    put_row,
    restore_row,
    save_row,
)
from etjax.engine.step_inputs import (
    BurstInputs,
    MixedInputs,
    StepGeometry,
    burst_inputs,
    mixed_inputs,
)
from etjax.entropy.cost import CostModel
from etjax.errors import ConfigError
from etjax.model.config import ModelConfig
from etjax.model.quantized import weights_bytes
from etjax.model.weights import Weights, routed_expert_bytes
from etjax.pruning.config import PruningThresholds
from etjax.pruning.groups import PrunedGroups
from etjax.runtime.footprint import check_fits
from etjax.runtime.options import RuntimeOptions
from etjax.runtime.state import DecodeState, StepOutputs
from etjax.runtime.steps import StepStatics, decode_steps, first_token, mixed_step

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
        devices: Sequence[jax.Device] | None = None,
        compile_only: bool = False,
    ) -> None:
        """`devices`: those the engine runs on (default: this process's). `compile_only`: the
        programs are lowered and compiled for `devices`, never run (etjax/planning: devices of a
        TPU topology this host does not have); the weights are shapes, and so are the KV pool
        and the row store: nothing is allocated, nor checked against this host's memory."""
        self.cfg, self.options, self.compile_only = cfg, options, compile_only
        options.experts.check_model(cfg)  # FieldError: steering a model it cannot steer
        self.vocab_size = cfg.vocab_size  # token ids the engine accepts
        self.context_limit = options.context_limit(cfg.max_position_embeddings)
        self.num_pages, self.rows = num_pages, options.resident_rows
        self.eos_ids = eos_ids or (-1,)
        platform = devices[0].platform if devices else None
        # The KV cache's dtype (None: the model's); "auto" resolves by platform here.
        self.kv_dtype = options.kv_cache_dtype(cfg.dtype, platform)
        shape = options.mesh_shape
        # One device: nothing is placed explicitly. A mesh: weights, pages and row state are
        # sharded once here, and every program keeps those shardings (etjax/distributed).
        self.placement = None if shape.size == 1 else Placement(make_mesh(shape, devices))
        self.weights = weights
        if not compile_only:  # before allocating anything
            check_fits(cfg, num_pages, options.page_size, self.rows, kv_dtype=self.kv_dtype)
        self._choose_steps(platform, shape.size)
        self._allocate(weights)
        self._start_rows()
        self.thresholds = self._thresholds()
        # What shapes the step programs (static); each call adds its rows' kept-table width.
        self.statics = StepStatics(
            cfg=cfg,
            cost=self.cost,
            placement=self.placement,
            attention_backend=self.attention_backend,
            experts=options.experts if options.experts.enabled else None,
        )

    def _choose_steps(self, platform: str | None, devices: int) -> None:
        # What the engine's steps are, chosen once: the attention (its kernels, and whether
        # rows prune: asked by the layout, the step programs and the layers alike,
        # etjax/attention/backend.py), the drafts' length, the layout's sizes and the costs.
        cfg, options = self.cfg, self.options
        self.attention_backend = resolve_backend(
            options.attention_backend, platform, devices, options.pruning.shape()
        )
        _check_tpu_kv_dtype(self.attention_backend, self.kv_dtype)
        # The most tokens a row drafts: speculation's, or a constrained row's forced run.
        self.max_draft = forced_draft_limit(options.speculation, options.steps_per_sync)
        # What a step's layout follows (etjax/engine/step_inputs.py).
        self.geometry = StepGeometry.for_engine(
            cfg, options, self.num_pages, self.attention_backend, self.max_draft
        )
        # The one cost model of this engine's model, KV dtype and pages, and what a burst
        # reads by it (for the grouping: etjax/engine/burst_cost.py).
        self.cost = CostModel.for_model(
            cfg,
            options.page_size,
            self.kv_dtype,
            resident_bytes=weights_bytes(self.weights),
            expert_resident_bytes=routed_expert_bytes(self.weights, cfg),
        )
        self.burst_cost = BurstCost(self.cost, self.geometry)
        # A new row draws its first token when it is inserted (`RowInit.draw`).
        self.draws_first_tokens = True

    def _start_rows(self) -> None:
        # The host's record of the rows: what each inserted row starts with and what the
        # rounds so far have left behind.
        # The entropy signal's calibration each inserted row gets (a traced [1] value: engines
        # with and without one share programs; etjax/calibration/signal.py).
        calibration = self.options.calibration
        self.calibration = row_params(1.0 if calibration is None else calibration.temperature)
        # Rows whose context is done: the logits of their last step [Sp, V] and their index.
        self._logits: dict[int, tuple[jax.Array, np.int32]] = {}
        self._burst_buckets: set[int] = set()  # row buckets of the bursts run so far
        self._constrained: set[int] = set()  # rows whose requests have a grammar
        # Rows inserted with their first token drawn (`RowInit.draw`), until `first_tokens`
        # hands it over: its outputs [1, 1] and the row's budget fraction, on the device.
        self._drawn: dict[int, tuple[StepOutputs, jax.Array]] = {}

    def _allocate(self, weights: Weights) -> None:
        # The KV pool and the row store (shapes only when compile-only), and on a mesh the
        # weights, pool and store placed with the shardings every program keeps.
        cfg, options, placement = self.cfg, self.options, self.placement
        # Pruning that ranks blocks by the mass they drew remembers it per store row (the pad
        # row included) and block of the pruned table; nothing else reads it.
        by_mass = self.attention_backend.prunes and options.pruning.ranks_by_mass
        allocate = jax.eval_shape if self.compile_only else (lambda make: make())
        make_cache = functools.partial(
            init_kv_cache,
            cfg,
            self.num_pages,
            options.page_size,
            self.rows + 1 if by_mass else 1,
            self.geometry.pruned_table_width if by_mass else 1,
            self.kv_dtype,
        )
        if self.compile_only or placement is not None:
            self.cache = allocate(make_cache)
        else:  # one device: the pool an engine of the same weights left, if it fits
            self.cache = spare_pool.take(weights, make_cache)
        self.store = allocate(functools.partial(empty_store, cfg, self.rows + 1, self.eos_ids))
        if placement is None:
            return
        if self.compile_only:  # shapes carry their shardings
            self.weights = _sharded(weights, placement.weights(weights))
            self.cache = _sharded(self.cache, placement.cache(self.cache))
            self.store = _sharded(self.store, placement.state(self.store, cfg.vocab_size))
        else:
            self.weights = placement.place_weights(weights)
            self.cache = placement.place_cache(self.cache)
            self.store = jax.device_put(self.store, placement.state(self.store, cfg.vocab_size))

    def _thresholds(self) -> PruningThresholds:
        # The pruning's thresholds, traced (engines that differ only in them share the
        # programs) and on the device once; its shape is in the statics. Under a calibration
        # the ramp moves onto the calibrated scale by the shift fitted with it, so the setting
        # keeps the budget it was chosen for (etjax/calibration/ramp.py).
        calibration = self.options.calibration
        thresholds = self.options.pruning.thresholds()
        if calibration is not None and calibration.ramp_shift:
            thresholds = shifted_thresholds(thresholds, calibration.ramp_shift)
        if self.compile_only:
            return jax.eval_shape(lambda: thresholds)
        replicated = None if self.placement is None else self.placement.replicated
        return jax.device_put(thresholds, replicated)

    # One ragged step ------------------------------------------------------------------------

    def mixed(self, rows, pages, lengths, budgets, jobs, drafts=None):
        """`Backend.mixed` (its arguments and results): one ragged step, each row of `rows`
        decoding a token and each job appending its chunk; a job's logits are kept for
        `insert`. Under pruning the rows read only their kept blocks. `drafts[j]` (at most
        `self.max_draft` tokens: speculation's, or a constrained row's forced ones,
        etjax/drafting/forced.py) run after row j's token and are verified."""
        step, arguments = self.mixed_arguments(rows, pages, lengths, budgets, jobs, drafts)
        self.store, self.cache, out, logits, target_logprobs = mixed_step(**arguments)
        for j, job in enumerate(jobs):
            self._logits[job.row] = (logits, np.int32(j))  # sliced inside the insert program
        asked = any(job.targets is not None for job in jobs)
        out, budget, target_logprobs = jax.device_get(
            (out, self.store.entropy.budget, target_logprobs if asked else None)
        )
        out = jax.tree.map(lambda x: x[:, : len(rows)], out)
        budget = np.asarray(budget)[step.rows[: len(rows)]]
        spans, start = [], step.row_tokens
        for job in jobs:
            n = len(job.tokens)
            asks = job.targets is not None
            spans.append(np.asarray(target_logprobs[start : start + n]) if asks else None)
            start += n
        costs = [self.cost.prefill_cost(job.start, len(job.tokens), len(jobs)) for job in jobs]
        return out, budget, costs, spans

    def mixed_arguments(
        self, rows, pages, lengths, budgets, jobs, drafts=None
    ) -> tuple[MixedInputs, dict]:
        """The layout of `mixed`'s step (its arguments as `Backend.mixed` takes them) and the
        keyword arguments it calls `mixed_step` with (what etjax/planning lowers)."""
        drafts = drafts or [[] for _ in rows]
        speculating = self.options.speculation.enabled
        step = mixed_inputs(
            self.geometry, rows, pages, lengths, budgets, jobs, drafts, speculating=speculating
        )
        own = dict(
            batch=step.batch, plan=step.plan, page_table=step.page_table, max_draft=step.max_draft
        )
        return step, self._program_arguments(rows, step, own)

    def _program_arguments(self, rows: list[int], step, own: dict) -> dict:
        # A step program's keyword arguments: the device's weights, pool, store and
        # thresholds, the step's store rows and the call's statics (`step`: its
        # MixedInputs or BurstInputs), and the program's `own`.
        return dict(
            weights=self.weights,
            cache=self.cache,
            store=self.store,
            rows=step.rows,
            thresholds=self.thresholds,
            statics=self._statics(rows, step.max_kept),
            **own,
        )

    def mixed_width(self, num_rows: int, prefilling: bool) -> int:
        """Padded decoding rows of a ragged step (`StepGeometry.mixed_width`)."""
        return self.geometry.mixed_width(num_rows, prefilling)

    def insert(self, row: int, init: RowInit) -> None:
        """Make `row` the resident state of a sequence whose context was just prefilled; a
        new one with `init.draw` draws its first token now, held pending (`first_tokens`
        hands it over)."""
        logits, index = self._logits.pop(row)
        length = len(init.prompt) + len(init.generated)
        if self.cache.block_mass.shape[1] > 1:  # a new sequence remembers no block's mass
            self.cache = forget_row_mass(self.cache, np.int32(row))
        if init.grammar >= 0:
            self._constrained.add(row)
        if init.saved is None:
            new = new_row(
                init.settings,
                init.prompt,
                length,
                self._first_mask(init.grammar),
                init.grammar,
                init.prefill_flops,
                init.prefill_bytes,
                self.cfg.vocab_size,
                self.calibration,
            )
            one = new_row_state(logits, index, new, self.store.eos_ids)
            if init.draw:
                one, outputs = first_token(one)
                self._drawn[row] = (outputs, one.entropy.budget)
            self.store = put_row(self.store, np.int32(row), one)
        else:
            self.store = restore_row(
                self.store,
                np.int32(row),
                logits,
                index,
                np.int32(length),
                init.saved,
                np.float32(init.prefill_flops),
                np.float32(init.prefill_bytes),
            )

    def first_tokens(self, rows: list[int]) -> tuple[StepOutputs, np.ndarray]:
        """`Backend.first_tokens`: the first tokens `rows` drew when inserted, outputs
        [1, len(rows)], and their budget fractions, in one transfer."""
        drawn = jax.device_get([self._drawn.pop(row) for row in rows])
        outputs = jax.tree.map(lambda *x: np.concatenate(x, axis=1), *[o for o, _ in drawn])
        return outputs, np.concatenate([b for _, b in drawn])

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
        self._drawn.pop(row, None)

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
        return jax.device_get(save_row(self.store, np.int32(row)))

    # Decode -----------------------------------------------------------------------------

    def decode(self, rows, pages, lengths, budgets, tokens_left=None):
        """`Backend.decode` (its arguments and results): `steps_per_sync` steps on `rows`.
        `tokens_left` chooses the burst's row bucket (`burst_rows`)."""
        num = self.burst_rows(len(rows), tokens_left)
        burst, arguments = self.burst_arguments(rows, pages, lengths, budgets, num)
        self.store, self.cache, out = decode_steps(**arguments)
        out, budget = jax.device_get((out, self.store.entropy.budget))
        out = jax.tree.map(lambda x: x[:, : len(rows)], out)
        spared = burst.spared
        if out.spared_blocks is not None:  # per step: the groups' counts follow the budgets
            spared = out.spared_blocks
        return out, np.asarray(budget)[burst.rows[: len(rows)]], spared

    def burst_arguments(self, rows, pages, lengths, budgets, num: int) -> tuple[BurstInputs, dict]:
        """The layout of a burst over `rows` (with their `pages`, `lengths` and `budgets` as
        `Backend.decode` takes them) padded to `num` rows, and the keyword arguments `decode`
        calls `decode_steps` with (what etjax/planning lowers)."""
        burst = burst_inputs(self.geometry, rows, pages, lengths, budgets, num)
        groups = burst.groups and PrunedGroups(*(jnp.asarray(x) for x in burst.groups))
        own = dict(
            page_table=burst.page_table,
            page_base=burst.page_base,
            plan=burst.plan,
            num_steps=self.options.steps_per_sync,
            groups=groups,
        )
        return burst, self._program_arguments(rows, burst, own)

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


def _sharded(tree, shardings):
    # A compile-only backend's arrays: shapes with the shardings the engine would place them
    # with (absent leaves stay None).
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


def _check_tpu_kv_dtype(backend, kv_dtype: str | None) -> None:
    # Mosaic takes no float16 operand (kernel arguments are bfloat16 or 32-bit), so a float16
    # pool reaches the TPU kernel only through a conversion, which XLA makes a copy of the
    # whole pool at every layer of every step (tests/test_tpu_compile.py). bfloat16 stores the
    # same 16 bits a value.
    if backend.name == "pallas_tpu" and not backend.interpret and kv_dtype == "float16":
        raise ConfigError(
            "kv_dtype='float16' on a TPU: its attention kernel cannot read float16 pages in "
            "place (Mosaic takes no float16 operand; converting them would copy the KV pool "
            "at every layer); use kv_dtype='bfloat16' or 'model'"
        )
