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
from etjax.model.config import ModelConfig
from etjax.model.weights import Weights
from etjax.runtime.buckets import batch_bucket, pages_bucket, prompt_bucket
from etjax.runtime.state import DecodeState
from etjax.runtime.steps import decode_steps, prefill_chunk
from etjax.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(frozen=True)
class SamplingSettings:
    """How one request is sampled and when it stops."""

    max_new_tokens: int
    temperature: float = 0.0
    seed: int = 0
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class RuntimeOptions:
    """Engine sizes. Larger `steps_per_sync` amortises host work; smaller streams more smoothly."""

    page_size: int = 16
    max_batch_size: int = 32
    prefill_chunk: int = 512
    max_prefill_rows: int = 8
    steps_per_sync: int = 8


@dataclass
class SequenceOutput:
    """What one prompt produced."""

    token_ids: list[int] = field(default_factory=list)
    entropy: list[float] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""  # "eos", "stop" (a stop string) or "length"


TextCallback = Callable[[int, str], None]


def generate_ids(
    weights: Weights,
    cfg: ModelConfig,
    tokenizer: Tokenizer,
    prompts: Sequence[Sequence[int]],
    settings: Sequence[SamplingSettings],
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

    def run(
        self, prompts: Sequence[Sequence[int]], settings: Sequence[SamplingSettings]
    ) -> list[SequenceOutput]:
        opts = self.options
        n = len(prompts)
        page_counts = [
            pages_needed(len(p) + s.max_new_tokens, opts.page_size)
            for p, s in zip(prompts, settings, strict=True)
        ]
        allocator = PageAllocator(pages_bucket(sum(page_counts) + 1))
        page_lists = [allocator.allocate(c) for c in page_counts]
        num_rows = batch_bucket(n)
        table = page_table_rows(page_lists + [[]] * (num_rows - n), pages_bucket(max(page_counts)))
        cache = init_kv_cache(self.cfg, allocator.num_pages, opts.page_size)

        temperature = np.zeros(num_rows, np.float32)
        seeds = np.zeros(num_rows, np.uint32)
        for i, s in enumerate(settings):
            temperature[i], seeds[i] = s.temperature, s.seed
        first, first_entropy, cache = self._prefill(cache, prompts, table, temperature, seeds)

        self.results = [SequenceOutput() for _ in range(n)]
        self.detokenizers = [IncrementalDetokenizer(self.tokenizer) for _ in range(n)]
        self.settings = settings
        active = np.zeros(num_rows, bool)
        for i in range(n):
            active[i] = self._accept(i, int(first[i]), float(first_entropy[i]))

        lengths = np.zeros(num_rows, np.int32)
        lengths[:n] = [len(p) for p in prompts]
        max_new = np.zeros(num_rows, np.int32)
        max_new[:n] = [s.max_new_tokens for s in settings]
        stop_on_eos = np.zeros(num_rows, bool)
        stop_on_eos[:n] = [not s.ignore_eos for s in settings]
        state = DecodeState(
            tokens=jnp.asarray(first, jnp.int32),
            lengths=jnp.asarray(lengths),
            page_table=jnp.asarray(table[:, :1]),  # narrowed to the live context below
            active=jnp.asarray(active),
            num_generated=jnp.asarray((np.arange(num_rows) < n).astype(np.int32)),
            max_new_tokens=jnp.asarray(max_new),
            temperature=jnp.asarray(temperature),
            seeds=jnp.asarray(seeds),
            stop_on_eos=jnp.asarray(stop_on_eos),
            eos_ids=jnp.asarray(self.eos_ids or (-1,), jnp.int32),
        )
        prompt_lengths = lengths[:n].copy()
        while active.any():
            state = self._fit_page_table(state, table, prompt_lengths, active)
            state, cache, out = decode_steps(
                self.weights, cache, state, self.cfg, opts.steps_per_sync
            )
            tokens, entropy, emitted, active = jax.device_get(
                (out.tokens, out.entropy, out.emitted, state.active)
            )
            stopped = []
            for k, row in zip(*np.nonzero(emitted), strict=True):
                finished = row < n and not self._accept(
                    row, int(tokens[k, row]), float(entropy[k, row])
                )
                if finished and active[row]:  # a stop string ended it before the device knew
                    stopped.append(row)
            if stopped:
                active = active.copy()
                active[stopped] = False
                state = state.replace(active=jnp.asarray(active))
        for i in range(n):
            self._finish(i)
        return self.results

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

    def _prefill(
        self,
        cache,
        prompts: Sequence[Sequence[int]],
        table: np.ndarray,
        temperature: np.ndarray,
        seeds: np.ndarray,
    ):
        # Long prompts are cut into chunks; round r prefills chunk r of every prompt that has one,
        # grouping rows whose chunks pad to the same length.
        opts = self.options
        chunk = opts.prefill_chunk
        first = np.zeros(table.shape[0], np.int32)
        first_entropy = np.zeros(table.shape[0], np.float32)
        longest = max(len(p) for p in prompts)
        for r in range(0, longest, chunk):
            by_bucket: dict[int, list[int]] = {}
            for i, p in enumerate(prompts):
                if len(p) > r:
                    by_bucket.setdefault(prompt_bucket(min(chunk, len(p) - r), chunk), []).append(i)
            for bucket, rows in by_bucket.items():
                for g in range(0, len(rows), opts.max_prefill_rows):
                    group = rows[g : g + opts.max_prefill_rows]
                    width = pages_bucket(pages_needed(r + bucket, opts.page_size))
                    width = min(width, table.shape[1])
                    num = batch_bucket(len(group))
                    tokens = np.zeros((num, bucket), np.int32)
                    num_valid = np.zeros(num, np.int32)
                    group_table = np.zeros((num, width), np.int32)
                    group_t = np.zeros(num, np.float32)
                    group_seeds = np.zeros(num, np.uint32)
                    for j, i in enumerate(group):
                        piece = prompts[i][r : r + bucket]
                        tokens[j, : len(piece)] = piece
                        num_valid[j] = len(piece)
                        group_table[j] = table[i, :width]
                        group_t[j], group_seeds[j] = temperature[i], seeds[i]
                    sampled, entropy, cache = prefill_chunk(
                        self.weights,
                        cache,
                        jnp.asarray(tokens),
                        jnp.full((num,), r, jnp.int32),
                        jnp.asarray(num_valid),
                        jnp.asarray(group_table),
                        jnp.asarray(group_t),
                        jnp.asarray(group_seeds),
                        cfg=self.cfg,
                    )
                    sampled, entropy = jax.device_get((sampled, entropy))
                    for j, i in enumerate(group):
                        if r + bucket >= len(prompts[i]):  # this chunk ended the prompt
                            first[i], first_entropy[i] = sampled[j], entropy[j]
        return first, first_entropy, cache

    def _accept(self, row: int, token: int, entropy: float) -> bool:
        """Record a sampled token; return whether the sequence continues."""
        result, s = self.results[row], self.settings[row]
        if result.finish_reason:
            return False
        result.token_ids.append(token)
        result.entropy.append(entropy)
        if not s.ignore_eos and token in self.eos_ids:
            result.finish_reason = "eos"
            return False
        piece = self.detokenizers[row].push(token)
        if self._emit(row, piece):
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
