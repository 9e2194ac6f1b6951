"""`DeviceBackend`: the engine's device half — the KV pool, resident rows, prefill and decode.

The engine (engine.py) decides; this executes. Resident sequences each own a row of one
`DecodeState` store on device with `rows + 1` rows (the last is a never-active pad row). A
decode burst gathers the rows the scheduler picked into a batch, runs `decode_steps` on it and
scatters the rows back, so which sequences share a device batch can change every round while
every shape stays bucketed. Page tables live on the host (the engine's page lists) and are
packed for each call.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from etjax.attention import PlanSizes, plan_segments
from etjax.cache.kv_cache import init_kv_cache
from etjax.cache.page_allocator import page_table_rows, pages_needed
from etjax.distributed.mesh import make_mesh
from etjax.distributed.placement import Placement
from etjax.entropy.cost import CostModel
from etjax.entropy.state import initial_entropy_state
from etjax.model.config import ModelConfig
from etjax.model.weights import Weights
from etjax.pruning.budget import kept_block_count
from etjax.runtime.buckets import batch_bucket, kept_bucket, pages_bucket, prompt_bucket
from etjax.runtime.options import RequestSettings, RuntimeOptions
from etjax.runtime.state import DecodeState, StepOutputs
from etjax.runtime.steps import decode_steps, prefill_chunk
from etjax.sampling.sampler import initial_sampler_state
from etjax.sampling.settings import pack_sampler_params
from pallas_kernels.ragged_attention import Segment


@dataclass(frozen=True)
class PrefillJob:
    """One chunk of a sequence's context to append to its pages."""

    row: int
    tokens: list[int]
    start: int  # position of tokens[0]
    pages: list[int]  # the sequence's pages (covering start + len(tokens))


@dataclass(frozen=True)
class RowInit:
    """What a row needs when its sequence becomes resident (first time or after preemption)."""

    prompt: list[int]
    generated: list[int]
    settings: RequestSettings
    saved: DecodeState | None  # the row as it was when preempted (host arrays), or None
    prefill_flops: float
    prefill_bytes: float


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
        self.cost = CostModel.for_model(cfg, options.page_size)
        self.num_pages = num_pages
        self.rows = options.resident_rows
        self.eos_ids = eos_ids or (-1,)
        shape = options.mesh_shape
        # One device: nothing is placed explicitly. A mesh: weights, pages and row state are
        # sharded once here, and every program keeps those shardings (etjax/distributed).
        self.placement = None if shape.size == 1 else Placement(make_mesh(shape))
        self.weights = weights
        self.cache = init_kv_cache(cfg, num_pages, options.page_size)
        self.store = _empty_store(cfg, self.rows + 1, self.eos_ids)
        if self.placement is not None:
            self.weights = self.placement.place_weights(weights)
            self.cache = self.placement.place_cache(self.cache)
            self.store = jax.device_put(
                self.store, self.placement.state(self.store, cfg.vocab_size)
            )
        self._logits: dict[int, jax.Array] = {}  # prefill logits of rows whose context is done
        # The longest page list a sequence can have: the model's context or the pool.
        self.max_seq_pages = min(
            pages_needed(cfg.max_position_embeddings, options.page_size), num_pages - 1
        )

    # Prefill ----------------------------------------------------------------------------

    def prefill(self, jobs: list[PrefillJob]) -> list[tuple[float, float]]:
        """Run chunks (one per sequence), packed into flat batches; returns (FLOPs, bytes) of
        each job. The logits after a job's last token are kept for `insert`."""
        opts, cost = self.options, self.cost
        costs = []
        for job in jobs:
            keys = np.asarray(
                cost.keys_read(np.arange(job.start + 1, job.start + len(job.tokens) + 1))
            )
            costs.append(
                (
                    len(job.tokens) * cost.matmul_flops_per_token
                    + cost.attention_flops_per_key * float(keys.sum()),
                    cost.weight_bytes / len(jobs) + cost.kv_bytes_per_key * float(keys.sum()),
                )
            )
        # Chunks are packed into flat batches of at most `prefill_chunk` tokens and
        # `max_prefill_rows` sequences; each token reads only the pages its position sees.
        for part in _pack(jobs, opts.prefill_chunk, opts.max_prefill_rows):
            self._prefill_batch(part)
        return costs

    def _prefill_batch(self, jobs: list[PrefillJob]) -> None:
        opts = self.options
        total = sum(len(j.tokens) for j in jobs)
        num_tokens = prompt_bucket(total, max(opts.prefill_chunk, total))
        rows = batch_bucket(opts.max_prefill_rows)
        tokens = np.zeros(num_tokens, np.int32)
        positions = np.zeros(num_tokens, np.int32)
        write_pages = np.zeros(num_tokens, np.int32)  # padding writes to the null page
        last_index = np.zeros(rows, np.int32)
        segments, start = [], 0
        for j, job in enumerate(jobs):
            n = len(job.tokens)
            span = slice(start, start + n)
            tokens[span] = job.tokens
            positions[span] = job.start + np.arange(n)
            write_pages[span] = np.asarray(job.pages, np.int32)[positions[span] // opts.page_size]
            last_index[j] = start + n - 1
            reach = job.start + n - 1
            pages = job.pages[: reach // opts.page_size + 1]
            segments.append(Segment(start, n, job.start, reach, pages))
            start += n
        sizes = PlanSizes.prefill(num_tokens, rows, self.max_seq_pages, opts.page_size)
        plan = plan_segments(segments, num_tokens, sizes)
        logits, self.cache = prefill_chunk(
            self.weights,
            self.cache,
            tokens,
            positions,
            write_pages,
            last_index,
            plan,
            cfg=self.cfg,
            placement=self.placement,
        )
        for j, job in enumerate(jobs):
            self._logits[job.row] = logits[j]

    def insert(self, row: int, init: RowInit) -> None:
        """Make `row` the resident state of a sequence whose context was just prefilled."""
        logits = self._logits.pop(row)
        length = len(init.prompt) + len(init.generated)
        if init.saved is None:
            one = _initial_row(self.cfg, init, self.eos_ids)
        else:
            one = init.saved
            one = one.replace(
                entropy=one.entropy.replace(
                    cost_flops=one.entropy.cost_flops + init.prefill_flops,
                    cost_bytes=one.entropy.cost_bytes + init.prefill_bytes,
                )
            )
        one = one.replace(
            logits=logits[None], lengths=jnp.asarray([length], jnp.int32), page_table=None
        )
        self.store = _put_rows(self.store, jnp.asarray([row], jnp.int32), one)

    def release(self, row: int) -> None:
        """Forget a row whose sequence finished or was preempted (its state is overwritten by
        the next `insert`; only prefill logits not yet inserted need dropping)."""
        self._logits.pop(row, None)

    def save(self, row: int) -> DecodeState:
        """The row's state on the host, to restore after its KV is recomputed."""
        one = _take_rows(self.store, jnp.asarray([row], jnp.int32))
        return jax.device_get(one.replace(logits=None, page_table=None, eos_ids=None))

    # Decode -----------------------------------------------------------------------------

    def row_width(self, length: int, budget: float) -> int:
        """Blocks a row of `length` tokens with budget fraction `budget` needs in a burst: its
        pages, or under pruning the blocks its budget keeps (what pads a burst's tables)."""
        opts = self.options
        blocks = pages_needed(length + opts.steps_per_sync, opts.page_size)
        if not opts.pruning.enabled:
            return blocks
        return int(kept_block_count(np.asarray([budget]), np.asarray([blocks]), opts.pruning)[0])

    def burst_bytes(self, lengths: list[int], budgets: list[float]) -> float:
        """Estimated bytes one step of a burst over these rows reads, with the shapes `decode`
        would give it: the weights once, every padded row's KV over the padded width (or the
        kept-block table under pruning, plus the per-page key bounds the selection scores)."""
        opts, cfg, cost = self.options, self.cfg, self.cost
        num = batch_bucket(len(lengths))
        pages = [pages_needed(n + opts.steps_per_sync, opts.page_size) for n in lengths]
        width = pages_bucket(max(pages))
        read = width
        scored = 0.0
        if opts.pruning.enabled:
            widest = max(self.row_width(n, b) for n, b in zip(lengths, budgets, strict=True))
            read = kept_bucket(widest, width)
            scored = num * width * 2.0 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
        return cost.weight_bytes + num * read * opts.page_size * cost.kv_bytes_per_key + scored

    def decode(
        self, rows: list[int], pages: list[list[int]], lengths: list[int], budgets: list[float]
    ) -> tuple[StepOutputs, np.ndarray]:
        """Run `steps_per_sync` steps on `rows`; returns the outputs [K, len(rows)] and each
        row's budget fraction for its next step (host arrays)."""
        opts = self.options
        k = opts.steps_per_sync
        num = batch_bucket(len(rows))
        index = np.full(num, self.rows, np.int32)  # pad rows: the never-active last row
        index[: len(rows)] = rows
        reach = [n + k for n in lengths]
        width = pages_bucket(max(pages_needed(r, opts.page_size) for r in reach))
        table = page_table_rows([p[:width] for p in pages] + [[]] * (num - len(rows)), width)
        max_kept = 0
        if opts.pruning.enabled:
            blocks = np.array([pages_needed(r, opts.page_size) for r in reach])
            needed = np.asarray(kept_block_count(np.asarray(budgets), blocks, opts.pruning))
            max_kept = kept_bucket(int(needed.max()), width)
        plan = None
        if not opts.pruning.enabled:
            segments = [
                Segment(j, 1, n, n + k - 1, p[: pages_needed(n + k, opts.page_size)])
                for j, (n, p) in enumerate(zip(lengths, pages, strict=True))
            ]
            sizes = PlanSizes.decode(num, self.num_pages, opts.page_size)
            plan = plan_segments(segments, num, sizes)
        batch = _take_rows(self.store, jnp.asarray(index)).replace(page_table=jnp.asarray(table))
        batch, self.cache, out = decode_steps(
            self.weights,
            self.cache,
            batch,
            self.cfg,
            self.cost,
            k,
            opts.pruning,
            max_kept,
            self.placement,
            plan,
        )
        self.store = _put_rows(self.store, jnp.asarray(index), batch.replace(page_table=None))
        out, budget = jax.device_get((out, batch.entropy.budget))
        out = jax.tree.map(lambda x: x[:, : len(rows)], out)
        return out, np.asarray(budget[: len(rows)])


def _pack(jobs: list[PrefillJob], max_tokens: int, max_rows: int) -> list[list[PrefillJob]]:
    # Consecutive jobs into batches of at most max_tokens tokens (a longer job alone) and
    # max_rows sequences.
    parts: list[list[PrefillJob]] = []
    used = 0
    for job in jobs:
        n = len(job.tokens)
        if not parts or used + n > max_tokens or len(parts[-1]) == max_rows:
            parts.append([])
            used = 0
        parts[-1].append(job)
        used += n
    return parts


@functools.partial(jax.jit, donate_argnums=0)
def _put_rows(store: DecodeState, rows: jax.Array, batch: DecodeState) -> DecodeState:
    # Scatter batch rows into the store; the shared eos ids and the (host-owned) page table
    # are not per-row state. Pad rows all point at the last row: whichever write wins there
    # is harmless, it never runs active.
    shared = dict(eos_ids=store.eos_ids, page_table=store.page_table)
    body = jax.tree.map(
        lambda s, b: s.at[rows].set(b.astype(s.dtype)),
        store.replace(eos_ids=None, page_table=None),
        batch.replace(eos_ids=None, page_table=None),
    )
    return body.replace(**shared)


@jax.jit
def _take_rows(store: DecodeState, rows: jax.Array) -> DecodeState:
    body = jax.tree.map(lambda s: s[rows], store.replace(eos_ids=None, page_table=None))
    return body.replace(eos_ids=store.eos_ids, page_table=None)


def _empty_store(cfg: ModelConfig, rows: int, eos_ids: tuple[int, ...]) -> DecodeState:
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
        sampler=params,
        entropy=initial_entropy_state(
            initial_sampler_state(params), jnp.asarray(zeros), jnp.asarray(zeros.copy())
        ),
    )


def _initial_row(cfg: ModelConfig, init: RowInit, eos_ids: tuple[int, ...]) -> DecodeState:
    in_prompt = np.zeros((1, cfg.vocab_size), bool)
    in_prompt[0, np.asarray(init.prompt, np.int64)] = True
    params = pack_sampler_params([init.settings.sampler], 1)
    return DecodeState(
        logits=None,
        lengths=None,
        page_table=None,
        active=jnp.ones(1, bool),
        num_generated=jnp.zeros(1, jnp.int32),
        max_new_tokens=jnp.asarray([init.settings.max_new_tokens], jnp.int32),
        stop_on_eos=jnp.asarray([not init.settings.ignore_eos]),
        eos_ids=None,
        token_counts=jnp.zeros((1, cfg.vocab_size), jnp.int32),
        in_prompt=jnp.asarray(in_prompt),
        sampler=params,
        entropy=initial_entropy_state(
            initial_sampler_state(params),
            jnp.asarray([init.prefill_flops], jnp.float32),
            jnp.asarray([init.prefill_bytes], jnp.float32),
        ),
    )
