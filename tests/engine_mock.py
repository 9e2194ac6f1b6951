"""A mock device for the engine's host logic: outputs anyone can compute by hand.

A request's prompt starts with its id r (or holds it at `id_at`: prompts that share a
beginning then still have ids of their own). At generation step i (0-based) it samples token
`token_of(r, i)` and the model entropy of that step is `entropy_of(r, i)`, given per id as a
start value and a slope (entropy falls by `slope` nats per token, floored at 0), so its
entropic-time gain per token is known exactly. The mock also checks the host's page
accounting: it keeps the token each slot of each page holds, so a row's pages must hold its
whole context (shared prefix pages included) whenever it is inserted or decodes; no page
another live row reads may be written; and every token must land in a page the row holds.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

import numpy as np

from etjax.engine.backend import PrefillJob, RowInit
from etjax.engine.engine import Engine
from etjax.engine.policies import make_policy
from etjax.runtime.options import FINISH_REASONS, TRACE_FIELDS, RuntimeOptions
from etjax.runtime.state import StepOutputs

EOS = 2


def token_of(request_id: int, step: int) -> int:
    return 10 + (request_id * 31 + step * 7) % 900


@dataclass
class _Row:
    request_id: int
    generated: int
    max_new: int
    stop_on_eos: bool
    length: int
    eos_at: int | None  # generation step at which the mock emits EOS, if any
    context: list[int]  # prompt and generated tokens: what its pages must hold up to length
    pending: bool = False  # its last token is drawn, not yet written (its next step runs it)


@dataclass
class MockBackend:
    num_pages: int
    steps_per_sync: int
    page_size: int
    entropy: dict[int, tuple[float, float]] = field(default_factory=dict)  # id -> (start, slope)
    # id -> (start, slope) of the calibrated entropy, the signal the host steers by; without
    # one, that of `entropy` (a device without a calibration).
    calibrated: dict[int, tuple[float, float]] = field(default_factory=dict)
    eos_at: dict[int, int] = field(default_factory=dict)  # id -> step that samples EOS
    # What a burst costs beyond its rows (burst_bytes); so large by default that splitting a
    # batch never pays, which keeps one burst per round unless a test lowers it.
    weight_bytes: float = 1e12
    vocab_size: int = 1000  # prompts hold request ids and 5; token_of stays below 910
    context_limit: int = 1 << 20  # the longest request it serves: none of the tests' reach it
    id_at: int = 0  # where in its prompt a request's id is
    # As the device: a new row draws its first token when inserted (RowInit.draw), which
    # its next step runs. Off: every first token comes from a decode.
    draws_first_tokens: bool = False

    def __post_init__(self) -> None:
        self.rows: dict[int, _Row] = {}
        self.prefilled: dict[int, int] = {}  # row -> tokens cached so far
        self.readers: dict[int, set[int]] = {}  # page -> live rows whose tables hold it
        self.read: dict[int, set[int]] = {}  # row -> the pages it reads (releases in O(pages))
        self.slots: dict[int, list[int | None]] = {}  # page -> the token in each slot
        self.row_pages: dict[int, list[int]] = {}  # row -> its pages (from its prefill jobs)
        self.prefill_tokens = 0  # tokens run by prefill jobs
        self.forks = 0  # rows that took another row's prefill result
        self.decode_log: list[list[int]] = []  # request ids of each decode burst
        self.burst_cost = self  # its own row_width and burst_bytes below
        self.drawn: dict[int, tuple] = {}  # row -> its first token's outputs, until handed

    def entropy_of(self, request_id: int, step: int) -> float:
        start, slope = self.entropy.get(request_id, (3.0, 0.0))
        return max(start - slope * step, 0.0)

    def calibrated_of(self, request_id: int, step: int) -> float:
        if request_id not in self.calibrated:
            return self.entropy_of(request_id, step)
        start, slope = self.calibrated[request_id]
        return max(start - slope * step, 0.0)

    def _claim(self, row: int, pages: list[int]) -> None:
        for page in pages:
            assert page != 0, "the null page was handed out"
            self.readers.setdefault(page, set()).add(row)
        self.read.setdefault(row, set()).update(pages)

    def _write(self, row: int, pages: list[int], start: int, tokens: list[int]) -> None:
        for position, token in enumerate(tokens, start):
            page = pages[position // self.page_size]
            others = self.readers.get(page, set()) - {row}
            assert not others, f"row {row} wrote page {page}, which rows {others} read"
            slots = self.slots.setdefault(page, [None] * self.page_size)
            slots[position % self.page_size] = token

    def _check_holds(self, pages: list[int], context: list[int]) -> None:
        held = [
            self.slots.get(pages[p // self.page_size], [None] * self.page_size)[p % self.page_size]
            for p in range(len(context))
        ]
        assert held == context, "a row's pages do not hold its context"

    def mixed(self, rows, pages, lengths, budgets, jobs: list[PrefillJob], drafts=None):
        # One step: the rows decode one token each, the jobs are cached.
        costs = self._prefill(jobs)
        # Prompt log-probabilities by hand: minus the target token's id.
        logprobs = [None if j.targets is None else -np.asarray(j.targets, np.float32) for j in jobs]
        if not rows:
            return None, np.ones(0, np.float32), costs, logprobs
        out, budgets = self._decode(rows, pages, lengths, 1)
        return out, budgets, costs, logprobs

    def _prefill(self, jobs: list[PrefillJob]) -> list[tuple[float, float]]:
        for job in jobs:
            assert job.row not in self.rows, "prefill into a row that is still resident"
            # A first chunk may start after a shared prefix (checked at insert).
            assert self.prefilled.get(job.row, job.start) == job.start
            end = job.start + len(job.tokens)
            assert len(job.pages) * self.page_size >= end, "prefill past the row's pages"
            self._claim(job.row, job.pages)
            self._write(job.row, job.pages, job.start, job.tokens)
            self.row_pages[job.row] = job.pages
            self.prefilled[job.row] = end
            self.prefill_tokens += len(job.tokens)
        return [(float(len(j.tokens)), float(len(j.tokens))) for j in jobs]

    def insert(self, row: int, init: RowInit) -> None:
        generated = len(init.generated)
        if init.saved is not None:
            assert init.saved["generated"] == generated  # the host restored the right state
        self.rows[row] = _Row(
            request_id=init.prompt[self.id_at],
            generated=generated,
            max_new=init.settings.max_new_tokens,
            stop_on_eos=not init.settings.ignore_eos,
            length=len(init.prompt) + generated,
            eos_at=self.eos_at.get(init.prompt[self.id_at]),
            context=list(init.prompt) + list(init.generated),
        )
        assert self.prefilled.pop(row) == self.rows[row].length
        pages = self.row_pages.pop(row)
        self._check_holds(pages, self.rows[row].context)
        if init.draw:  # its step-0 token now, held pending (`first_tokens` hands it over)
            assert self.draws_first_tokens and init.saved is None
            state = self.rows[row]
            self.drawn[row] = self._decode([row], [pages], [state.length], 1, first=True)

    def first_tokens(self, rows: list[int]):
        drawn = [self.drawn.pop(row) for row in rows]
        outputs = {
            f.name: None
            if getattr(drawn[0][0], f.name) is None
            else np.concatenate([getattr(o, f.name) for o, _ in drawn], axis=1)
            for f in dataclasses.fields(StepOutputs)
        }
        return StepOutputs(**outputs), np.concatenate([b for _, b in drawn])

    def fork(self, source: int, row: int, pages: list[int], copy) -> None:
        # As the device does: the source's prefill result, its partial last page copied.
        assert source not in self.rows and row not in self.rows, "fork of a resident row"
        assert row not in self.prefilled, "fork into a row that is prefilling"
        self._claim(row, pages)
        if copy is not None:
            page, into = copy
            assert into in pages and page not in pages, "the copy must land in a page of its own"
            others = self.readers.get(into, set()) - {row}
            assert not others, f"fork copied into page {into}, which rows {others} read"
            self.slots[into] = list(self.slots[page])
        self.row_pages[row] = pages
        self.prefilled[row] = self.prefilled[source]
        self.forks += 1

    def release(self, row: int) -> None:
        self.drawn.pop(row, None)
        self.rows.pop(row, None)
        self.prefilled.pop(row, None)
        self.row_pages.pop(row, None)
        for page in self.read.pop(row, ()):
            self.readers[page].discard(row)

    def save(self, row: int):
        state = self.rows.pop(row)
        return {"generated": state.generated}

    def row_width(self, length: int, budget: float) -> int:
        return length

    def burst_bytes(self, lengths, budgets) -> float:
        # Hand-computable: the weights plus every row read at the longest length.
        return self.weight_bytes + len(lengths) * max(lengths)

    def decode(self, rows, pages, lengths, budgets, tokens_left=None):
        # The engine's bound on the burst's tokens is the mock's own count of what is left.
        left = max(self.rows[r].max_new - self.rows[r].generated for r in rows)
        assert tokens_left == left, f"tokens_left={tokens_left}; the rows have {left} to go"
        out, budgets = self._decode(rows, pages, lengths, self.steps_per_sync)
        return out, budgets, np.zeros(len(rows), np.float32)  # reads nothing for others

    def _decode(self, rows, pages, lengths, k, first=False):
        # `first`: the rows' first tokens, drawn when they are inserted: held pending, not
        # written. A row holding one runs it in its next step, which then draws nothing (a
        # burst's first step).
        n = len(rows)
        arrays = {
            name: np.zeros((k, n), np.int32 if name == "kept_blocks" else np.float32)
            for name in TRACE_FIELDS.values()
        }
        tokens = np.zeros((k, n), np.int32)
        emitted = np.zeros((k, n), bool)
        finish = np.zeros((k, n), np.int8)
        if not first:
            self.decode_log.append([self.rows[r].request_id for r in rows])
        for j, (row, row_pages, length) in enumerate(zip(rows, pages, lengths, strict=True)):
            state = self.rows[row]
            assert state.length == length, "host and device disagree on the length"
            assert len(row_pages) * self.page_size >= length + k, "burst past the row's pages"
            self._claim(row, row_pages)
            self._check_holds(row_pages, state.context[:length])
            steps = range(k)
            if state.pending:  # its step 0 runs the token drawn with its prompt
                self._write(row, row_pages, state.length, [state.context[-1]])
                state.length, state.pending = state.length + 1, False
                steps = range(1, k)
            for step in steps:
                if state.generated >= state.max_new:
                    break
                i = state.generated
                eos = state.eos_at == i
                tokens[step, j] = EOS if eos else token_of(state.request_id, i)
                arrays["model_entropy"][step, j] = self.entropy_of(state.request_id, i)
                arrays["calibrated_entropy"][step, j] = self.calibrated_of(state.request_id, i)
                emitted[step, j] = True
                state.generated += 1
                # As on the device: a finishing token is not run through the model, and the
                # step says what it ended.
                if eos and state.stop_on_eos:
                    finish[step, j] = FINISH_REASONS.index("eos")
                elif state.generated >= state.max_new:
                    finish[step, j] = FINISH_REASONS.index("length")
                state.context.append(int(tokens[step, j]))
                if finish[step, j]:
                    break
                if first:
                    state.pending = True
                    break
                self._write(row, row_pages, state.length, [int(tokens[step, j])])
                state.length += 1
        return (
            StepOutputs(tokens=tokens, emitted=emitted, finish=finish, **arrays),
            np.ones(n, np.float32),
        )


PAGE, K = 4, 2  # the mock engine's page size and steps per burst


def mock_engine(
    policy="fcfs",
    batch=2,
    resident=None,
    pages=256,
    rounds=4,
    prefill_chunk=8,
    prefix_cache=True,
    **mock,
) -> tuple[Engine, MockBackend]:
    """An engine over the mock with pages of PAGE tokens and bursts of K steps, on a clock
    that ticks once per reading; costs in bytes: weights 1000, 1 per cached key
    (hand-computable priorities)."""
    options = RuntimeOptions(
        page_size=PAGE,
        max_batch_size=batch,
        max_resident=resident,
        steps_per_sync=K,
        prefill_chunk=prefill_chunk,
        max_prefill_rows=2,
        policy=policy,
        min_advance_rounds=rounds,
        prefix_cache=prefix_cache,
    )
    backend = MockBackend(pages, K, PAGE, **mock)
    tick = itertools.count()
    engine = Engine(
        backend,
        None,
        options,
        make_policy(policy, 1000.0, 1.0, batch, PAGE),
        clock=lambda: float(next(tick)),
    )
    return engine, backend


def serve_request(request_id: int, max_new: int = 4):
    """The server's request for the mock's request `request_id` ([request_id, 5, 6]): one
    greedy sample of `max_new` tokens, end of sequence ignored, not streamed."""
    from etjax.request_fields import RequestSettings
    from etjax.serve.body import ServeRequest

    return ServeRequest(
        url="/v1/completions",
        model=None,
        prompt_ids=[request_id, 5, 6],
        samples=[RequestSettings(max_new_tokens=max_new, ignore_eos=True)],
        priority=0.0,
        stream=False,
        include_usage=False,
        logprobs=False,
        trace=False,
    )
