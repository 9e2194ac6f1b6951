"""The host generation loop: allocate pages, prefill in chunks, decode in K-step bursts.

Prompts are served in waves of at most `max_batch_size` sequences. Each wave gets its own page
pool sized for its prompts plus their token budgets, so no sequence can run out of pages. The
continuous-batching engine (later) replaces waves with admission as pages free up.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from etjax.cache.kv_cache import init_kv_cache
from etjax.cache.page_allocator import PageAllocator, page_table_rows, pages_needed
from etjax.entropy.cost import CostModel
from etjax.entropy.state import initial_entropy_state
from etjax.model.config import ModelConfig
from etjax.model.weights import Weights
from etjax.pruning.budget import kept_block_count
from etjax.pruning.config import PruningConfig
from etjax.runtime.buckets import batch_bucket, kept_bucket, pages_bucket, prompt_bucket
from etjax.runtime.state import DecodeState, StepOutputs
from etjax.runtime.steps import decode_steps, prefill_chunk
from etjax.sampling.sampler import initial_sampler_state
from etjax.sampling.settings import SamplerSettings, pack_sampler_params
from etjax.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(frozen=True)
class RequestSettings:
    """How long one request runs, when it stops, and how it samples."""

    max_new_tokens: int
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    sampler: SamplerSettings = field(default_factory=SamplerSettings)


@dataclass(frozen=True)
class RuntimeOptions:
    """Engine sizes. Larger `steps_per_sync` amortises host work; smaller streams more smoothly."""

    page_size: int = 16
    max_batch_size: int = 32
    prefill_chunk: int = 512
    max_prefill_rows: int = 8
    steps_per_sync: int = 8
    pruning: PruningConfig = field(default_factory=PruningConfig)


@dataclass
class SequenceOutput:
    """What one prompt produced, with the per-token trace of the entropy signal."""

    token_ids: list[int] = field(default_factory=list)
    entropy: list[float] = field(default_factory=list)  # model entropy, T = 1, nats
    logprob: list[float] = field(default_factory=list)  # of the token under the model, T = 1
    sampled_entropy: list[float] = field(default_factory=list)  # of the distribution sampled
    temperature: list[float] = field(default_factory=list)  # 0 = greedy
    tau: list[float] = field(default_factory=list)  # entropic time after each token
    cost_flops: list[float] = field(default_factory=list)  # cumulative, prefill included
    cost_bytes: list[float] = field(default_factory=list)  # cumulative, prefill included
    kept_blocks: list[int] = field(default_factory=list)  # blocks read per layer and KV head
    text: str = ""
    finish_reason: str = ""  # "eos", "stop" (a stop string) or "length"


TextCallback = Callable[[int, str], None]


def generate_ids(
    weights: Weights,
    cfg: ModelConfig,
    tokenizer: Tokenizer,
    prompts: Sequence[Sequence[int]],
    settings: Sequence[RequestSettings],
    options: RuntimeOptions = RuntimeOptions(),
    on_text: TextCallback | None = None,
) -> list[SequenceOutput]:
    """Generate a continuation for each tokenized prompt (already validated).

    `on_text(i, piece)` receives the text of prompt i as it is produced. Returns one
    `SequenceOutput` per prompt, in order.
    """
    outputs: list[SequenceOutput] = []
    for start in range(0, len(prompts), options.max_batch_size):
        wave = range(start, min(start + options.max_batch_size, len(prompts)))
        callback = None if on_text is None else _offset_callback(on_text, start)
        outputs += _Wave(weights, cfg, tokenizer, options, callback).run(
            [prompts[i] for i in wave], [settings[i] for i in wave]
        )
    return outputs


def _offset_callback(on_text: TextCallback, offset: int) -> TextCallback:
    return lambda row, piece: on_text(offset + row, piece)


class _Wave:
    """One batch of sequences decoded together from prefill to their last token."""

    def __init__(
        self,
        weights: Weights,
        cfg: ModelConfig,
        tokenizer: Tokenizer,
        options: RuntimeOptions,
        on_text: TextCallback | None,
    ) -> None:
        self.weights, self.cfg, self.tokenizer, self.options = weights, cfg, tokenizer, options
        self.on_text = on_text
        self.eos_ids = tuple(tokenizer.eos_token_ids)
        self.cost = CostModel.for_model(cfg, options.page_size)

    def run(
        self, prompts: Sequence[Sequence[int]], settings: Sequence[RequestSettings]
    ) -> list[SequenceOutput]:
        opts, n = self.options, len(prompts)
        page_counts = [
            pages_needed(len(p) + s.max_new_tokens, opts.page_size)
            for p, s in zip(prompts, settings, strict=True)
        ]
        allocator = PageAllocator(pages_bucket(sum(page_counts) + 1))
        page_lists = [allocator.allocate(c) for c in page_counts]
        num_rows = batch_bucket(n)
        table = page_table_rows(page_lists + [[]] * (num_rows - n), pages_bucket(max(page_counts)))
        cache = init_kv_cache(self.cfg, allocator.num_pages, opts.page_size)
        logits, prefill_flops, prefill_bytes, cache = self._prefill(cache, prompts, table)

        self.results = [SequenceOutput() for _ in range(n)]
        self.detokenizers = [IncrementalDetokenizer(self.tokenizer) for _ in range(n)]
        self.settings = settings
        state = self._initial_state(prompts, settings, table, logits, prefill_flops, prefill_bytes)
        prompt_lengths = np.array([len(p) for p in prompts])
        active = np.asarray(state.active)
        budget = np.ones(table.shape[0], np.float32)
        while active.any():
            state = self._fit_page_table(state, table, prompt_lengths, active)
            state, cache, out = decode_steps(
                self.weights,
                cache,
                state,
                self.cfg,
                self.cost,
                opts.steps_per_sync,
                opts.pruning,
                self._max_kept(state.page_table.shape[1], prompt_lengths, active, budget),
            )
            out, active, budget = jax.device_get((out, state.active, state.entropy.budget))
            stopped = self._collect(out, active, n)
            if stopped:
                active = active.copy()
                active[stopped] = False
                state = state.replace(active=jnp.asarray(active))
        for i in range(n):
            self._finish(i)
        return self.results

    def _initial_state(self, prompts, settings, table, logits, prefill_flops, prefill_bytes):
        n, num_rows, vocab = len(prompts), table.shape[0], self.cfg.vocab_size
        real = np.arange(num_rows) < n
        in_prompt = np.zeros((num_rows, vocab), bool)
        for i, p in enumerate(prompts):
            in_prompt[i, np.asarray(p, np.int64)] = True

        def column(values, dtype, fill=0):
            out = np.full(num_rows, fill, dtype)
            out[:n] = values
            return jnp.asarray(out)

        params = pack_sampler_params([s.sampler for s in settings], num_rows)
        return DecodeState(
            logits=logits,
            lengths=column([len(p) for p in prompts], np.int32),
            page_table=jnp.asarray(table[:, :1]),  # narrowed to the live context before each burst
            active=jnp.asarray(real),
            num_generated=jnp.zeros(num_rows, jnp.int32),
            max_new_tokens=column([s.max_new_tokens for s in settings], np.int32),
            stop_on_eos=column([not s.ignore_eos for s in settings], bool),
            eos_ids=jnp.asarray(self.eos_ids or (-1,), jnp.int32),
            token_counts=jnp.zeros((num_rows, vocab), jnp.int32),
            in_prompt=jnp.asarray(in_prompt),
            sampler=params,
            entropy=initial_entropy_state(
                initial_sampler_state(params),
                jnp.asarray(prefill_flops),
                jnp.asarray(prefill_bytes),
            ),
        )

    def _collect(self, out: StepOutputs, active: np.ndarray, n: int) -> list[int]:
        """Record every emitted token; return rows a stop string ended before the device knew."""
        stopped = []
        for k, row in zip(*np.nonzero(out.emitted), strict=True):
            if row >= n:
                continue
            trace = (
                float(out.model_entropy[k, row]),
                float(out.logprob[k, row]),
                float(out.sampled_entropy[k, row]),
                float(out.temperature[k, row]),
                float(out.tau[k, row]),
                float(out.cost_flops[k, row]),
                float(out.cost_bytes[k, row]),
                int(out.kept_blocks[k, row]),
            )
            if not self._accept(row, int(out.tokens[k, row]), trace) and active[row]:
                stopped.append(row)
        return stopped

    def _fit_page_table(
        self, state: DecodeState, table: np.ndarray, prompt_lengths: np.ndarray, active: np.ndarray
    ) -> DecodeState:
        # Attention reads every page in the table, so pass only as many columns as the longest
        # active sequence can reach in the coming burst, rounded up to a bucket: the cost then
        # follows the live context, not the reservation for max_new_tokens.
        reach = max(
            prompt_lengths[i] + len(self.results[i].token_ids) + self.options.steps_per_sync
            for i in np.nonzero(active[: len(prompt_lengths)])[0]
        )
        width = min(pages_bucket(pages_needed(reach, self.options.page_size)), table.shape[1])
        if state.page_table.shape[1] == width:
            return state
        return state.replace(page_table=jnp.asarray(table[:, :width]))

    def _max_kept(
        self, width: int, prompt_lengths: np.ndarray, active: np.ndarray, budget: np.ndarray
    ) -> int:
        # The kept-block table is static per compiled step: size it for the largest budget any
        # active row can need in the coming burst (its last budget fraction at the burst's
        # longest context), rounded up to a bucket. A budget that grows within the burst is
        # clipped to it until the next sync.
        if not self.options.pruning.enabled:
            return 0
        rows = np.nonzero(active[: len(prompt_lengths)])[0]
        reach = (
            prompt_lengths[rows]
            + np.array([len(self.results[i].token_ids) for i in rows])
            + self.options.steps_per_sync
        )
        blocks = -(-reach // self.options.page_size)
        needed = np.asarray(kept_block_count(budget[rows], blocks, self.options.pruning))
        return kept_bucket(int(needed.max()), width)

    def _prefill(self, cache, prompts: Sequence[Sequence[int]], table: np.ndarray):
        # Long prompts are cut into chunks; round r prefills chunk r of every prompt that has one,
        # grouping rows whose chunks pad to the same length. Returns the logits of each row's
        # next token [rows, V], the prompt cost per row, and the cache.
        opts, cost = self.options, self.cost
        num_rows = table.shape[0]
        logits = jnp.zeros((num_rows, self.cfg.vocab_size), jnp.float32)
        flops, nbytes = np.zeros(num_rows, np.float32), np.zeros(num_rows, np.float32)
        chunk = opts.prefill_chunk
        for r in range(0, max(len(p) for p in prompts), chunk):
            by_bucket: dict[int, list[int]] = {}
            for i, p in enumerate(prompts):
                if len(p) > r:
                    by_bucket.setdefault(prompt_bucket(min(chunk, len(p) - r), chunk), []).append(i)
            for bucket, rows in by_bucket.items():
                for g in range(0, len(rows), opts.max_prefill_rows):
                    group = rows[g : g + opts.max_prefill_rows]
                    width = min(
                        pages_bucket(pages_needed(r + bucket, opts.page_size)), table.shape[1]
                    )
                    num = batch_bucket(len(group))
                    tokens = np.zeros((num, bucket), np.int32)
                    num_valid = np.zeros(num, np.int32)
                    group_table = np.zeros((num, width), np.int32)
                    for j, i in enumerate(group):
                        piece = prompts[i][r : r + bucket]
                        tokens[j, : len(piece)] = piece
                        num_valid[j] = len(piece)
                        group_table[j] = table[i, :width]
                        keys = np.asarray(cost.keys_read(np.arange(r + 1, r + len(piece) + 1)))
                        flops[i] += len(piece) * cost.matmul_flops_per_token + (
                            cost.attention_flops_per_key * keys.sum()
                        )
                        nbytes[i] += cost.weight_bytes / len(group) + cost.kv_bytes_per_key * (
                            keys.sum()
                        )
                    group_logits, cache = prefill_chunk(
                        self.weights,
                        cache,
                        jnp.asarray(tokens),
                        jnp.full((num,), r, jnp.int32),
                        jnp.asarray(num_valid),
                        jnp.asarray(group_table),
                        cfg=self.cfg,
                    )
                    # Rows whose prompt ends in this chunk take its logits; a later chunk of a
                    # longer prompt overwrites the row again.
                    logits = logits.at[jnp.asarray(group)].set(group_logits[: len(group)])
        return logits, flops, nbytes, cache

    def _accept(self, row: int, token: int, trace: tuple[float, ...]) -> bool:
        """Record a sampled token and its trace; return whether the sequence continues."""
        result, s = self.results[row], self.settings[row]
        if result.finish_reason:
            return False
        result.token_ids.append(token)
        for values, value in zip(
            (
                result.entropy,
                result.logprob,
                result.sampled_entropy,
                result.temperature,
                result.tau,
                result.cost_flops,
                result.cost_bytes,
                result.kept_blocks,
            ),
            trace,
            strict=True,
        ):
            values.append(value)
        if not s.ignore_eos and token in self.eos_ids:
            result.finish_reason = "eos"
            return False
        if self._emit(row, self.detokenizers[row].push(token)):
            return False
        if len(result.token_ids) >= s.max_new_tokens:
            result.finish_reason = "length"
            return False
        return True

    def _emit(self, row: int, piece: str) -> bool:
        # Append text and look for a stop string in the region the new piece could complete.
        result, stops = self.results[row], self.settings[row].stop
        if not piece:
            return False
        before = len(result.text)
        result.text += piece
        for stop in stops:
            at = result.text.find(stop, max(0, before - len(stop) + 1))
            if at >= 0:
                result.text = result.text[:at]
                result.finish_reason = "stop"
                piece = result.text[before:]
                break
        if self.on_text is not None and piece:
            self.on_text(row, piece)
        return result.finish_reason == "stop"

    def _finish(self, row: int) -> None:
        result = self.results[row]
        if result.finish_reason != "stop":
            self._emit(row, self.detokenizers[row].flush())
        if not result.finish_reason:
            result.finish_reason = "length"
