"""`Engine`: continuous batching over the paged KV pool, one scheduler round at a time.

A round (`step`):
  1. cancelled requests release their row and pages;
  2. waiting requests are admitted in the policy's order while a resident row and pages for
     their context plus one burst are free, keeping a reserve so resident sequences can grow;
     a context's first full pages that the prefix cache holds are shared, not allocated,
     and prefill starts after them; a request whose next page another admitted request is
     still prefilling waits for it (etjax/cache/prefix_cache.py);
  3. the scheduler picks up to `max_batch_size` resident sequences (the deadlines the
     minimum-advancement guarantee needs first, then by the policy's priority); each gets
     pages for a burst, preempting the policy's least valuable resident sequence if the pool
     is short (recompute: its pages are freed, its sampler and entropy state are kept on the
     host, and its prompt plus generated tokens are prefilled again when it is readmitted);
  4. with speculation on, confident sequences of the batch draft tokens (etjax/drafting);
     admitted sequences get their next prompt chunk (at most `prefill_chunk` tokens each, at
     most `max_prefill_rows` of them) within what the token budget leaves after one token
     (and its drafts) per picked sequence; a policy may have the chunks wait and the batch
     burst instead, for a bounded time (etjax/engine/scheduler.py, `prefill_waits`);
  5. the device runs one ragged step: the batch's sequences decode a token each (and verify
     their drafts: etjax/runtime/verify.py) and the chunks are appended, in one flat batch;
     a finished context makes its sequence resident, and waiting sequences with the same
     context fork from it (its pages shared, its partial last page copied, its logits);
     a new resident row draws its first token at once, streamed with this round (the row
     holds it pending: its next step runs it; etjax/runtime/steps.py `first_token`).
     With nothing to prefill or verify, the batch runs `steps_per_sync` decode steps in one
     `lax.scan` instead (as a few bursts of rows of similar attention width when that reads
     fewer bytes: grouping.py; with ragged attention that only pays under pruning). The
     host streams the new tokens, applies stop strings and frees finished sequences.

The host loop is plain, single-threaded Python over a small backend interface (`mixed`,
`decode`, insert, first_tokens, fork, save, release, and a burst's estimated bytes for the
grouping), so the same
code runs on the device (`DeviceBackend`) and on a mock with hand-computable outputs in the tests.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np

from etjax.cache.page_allocator import pages_needed
from etjax.cache.prefix_cache import CachedPage, PrefixCache
from etjax.constraints.matcher import failure as grammar_failure
from etjax.constraints.matcher import register as register_grammar
from etjax.constraints.matcher import release as release_grammar
from etjax.drafting import (
    DraftHistory,
    StepCosts,
    compile_events,
    draft_lengths,
    lookup_draft,
    lookup_within_grammar,
    matched_tail,
    record_verification,
    with_forced_drafts,
)
from etjax.engine import scheduler
from etjax.engine.backend import Backend, PrefillJob, RowInit
from etjax.engine.feed import run_fed
from etjax.engine.grouping import split_by_width
from etjax.engine.policies import Policy
from etjax.engine.sequence import Sequence, Status
from etjax.errors import RequestError
from etjax.runtime.options import (
    FINISH_REASONS,
    TRACE_FIELDS,
    RequestSettings,
    RuntimeOptions,
    SequenceOutput,
)
from etjax.tokenizer import IncrementalDetokenizer, Tokenizer

FEED_PER_ROW = 4  # see Engine.feed_window


@dataclass(frozen=True)
class EngineStats:
    """The engine's load, as of its last round or submission (`Engine.stats`). Requests:
    `waiting` (queued or preempted, not cancelled), `prefilling` (admitted, context being
    cached), `running` (resident, decoding). KV pages: `kv_pages_used` (held by live
    requests), `kv_pages_free` (what an allocation can get: free pages and cached pages
    nobody holds), `kv_pages_total` (the pool, its null page aside). Counters since the
    engine was built: requests submitted and finished (cancelled ones included), tokens
    generated (those of cancelled requests included), preemptions, rounds and model passes."""

    waiting: int = 0
    prefilling: int = 0
    running: int = 0
    kv_pages_used: int = 0
    kv_pages_free: int = 0
    kv_pages_total: int = 0
    submitted: int = 0
    finished: int = 0
    tokens_generated: int = 0
    preemptions: int = 0
    rounds: int = 0
    model_passes: int = 0


@dataclass(frozen=True)
class OutputDelta:
    """A request's output since its handle's previous `delta()`: the text and tokens, each
    new token's top log-probabilities (None unless asked) and trace values (TRACE_FIELDS ->
    one value per new token; the sampled token's `logprob` among them); `finish_reason` is
    set on the last delta only ("eos", "stop", "length", "cancelled" or "error")."""

    text: str
    token_ids: list[int]
    top_logprobs: list[list[tuple[int, float]]] | None
    trace: dict[str, list[float]]
    finish_reason: str | None = None


class RequestHandle:
    """A submitted request: iterate it for its text as it is produced, or wait for `result`."""

    def __init__(self, engine: Engine, seq: Sequence) -> None:
        self._engine, self._seq = engine, seq
        self._delivered = 0  # tokens `delta` handed over so far
        self._closed = False  # `delta` handed over the last one

    def __iter__(self) -> Iterator[str]:
        seq = self._seq
        while True:
            while seq.pending_text:
                yield seq.pending_text.pop(0)
            if seq.finished:
                return
            self._engine.step()

    def result(self) -> SequenceOutput:
        """Run the engine until this request is done; its output with metrics."""
        while not self._seq.finished:
            self._engine.step()
        return self._seq.output

    def drain(self) -> list[str]:
        """Text produced since the last call, without running the engine."""
        pieces, self._seq.pending_text[:] = list(self._seq.pending_text), []
        return pieces

    def delta(self) -> OutputDelta | None:
        """What the request produced since the last call, without running the engine (what
        a stream sends after each round); None when nothing is new. The text is `drain`'s:
        use one or the other. The last delta carries the finish reason; None after it."""
        seq, out = self._seq, self._seq.output
        if self._closed:
            return None
        start, end = self._delivered, len(out.token_ids)
        text = "".join(self.drain())
        if end == start and not text and not seq.finished:
            return None
        self._delivered, self._closed = end, seq.finished
        tops = out.top_logprobs
        return OutputDelta(
            text=text,
            token_ids=out.token_ids[start:end],
            top_logprobs=None if tops is None else [list(p) for p in tops[start:end]],
            trace={name: getattr(out, name)[start:end] for name in TRACE_FIELDS},
            finish_reason=out.finish_reason if seq.finished else None,
        )

    def cancel(self) -> None:
        """Stop generating; the pages are released at the next round."""
        self._seq.cancelled = True

    @property
    def done(self) -> bool:
        return self._seq.finished

    @property
    def sequence(self) -> Sequence:
        """The host's record of the request: status, timings, preemptions."""
        return self._seq

    @property
    def output(self) -> SequenceOutput:
        """The output so far (complete once `done`)."""
        return self._seq.output


class Engine:
    """Serve requests over one model with continuous batching (see the module docstring)."""

    def __init__(
        self,
        backend: Backend,
        tokenizer: Tokenizer | None,
        options: RuntimeOptions,
        policy: Policy,
        clock: Callable[[], float] = time.perf_counter,
        step_costs: StepCosts | None = None,
    ) -> None:
        """`step_costs`: where the engine records what its burst and verifying steps take
        and the cost gate reads it (etjax/drafting/costs.py; `build_engine` passes the
        process's table for the model); None: the gate's cost model alone (a mock device,
        whose timings mean nothing)."""
        scheduler.check_starvation_bound(
            options.resident_rows, options.max_batch_size, options.min_advance_rounds
        )
        self.backend, self.tokenizer = backend, tokenizer
        self.options, self.policy, self.clock = options, policy, clock
        # The pool: free pages and pages indexed by the prefix they hold (prefix_cache.py).
        self.page_cache = PrefixCache(
            backend.num_pages, options.page_size, enabled=options.prefix_cache
        )
        self.free_rows = list(range(options.resident_rows - 1, -1, -1))
        # Only unfinished sequences are kept: a round costs time in the live work, not in
        # everything ever submitted (a finished one lives on in its handle, if anyone holds it).
        self.live: list[Sequence] = []
        self.submitted = 0
        self.round = 0
        self.decode_rounds = 0  # rounds that decoded
        self.decode_bursts = 0  # device decode calls (a round may run several)
        self.model_passes = 0  # model passes that gave decoding rows tokens (weights read)
        self.host_seconds = 0.0  # scheduler and collection time, excluding device calls
        self.device_seconds = 0.0
        self.finished = 0  # requests finished, cancelled ones included
        self.tokens_generated = 0
        self.preemptions = 0
        self._stats = EngineStats()
        # How the engine's lookup drafts fared so far, all sequences pooled: where a new
        # sequence's own estimate starts (etjax/drafting/rule.py, "Where an estimate starts").
        self.draft_pool = DraftHistory(options.speculation.acceptance_prior)
        self.step_costs = step_costs
        self._drawing: list[Sequence] = []  # made resident this round, first token drawn
        # Prompt chunks waiting for bursts (scheduler.py, `prefill_waits`): the seconds of
        # the rounds in a row they waited; those of the last round with chunks; what the last
        # round was ("chunks", "waited" or None) and when it started.
        self._waited_seconds, self._chunk_seconds = 0.0, 0.0
        self._round_kind: str | None = None
        self._round_started = 0.0
        self._publish_stats()

    # Submission -------------------------------------------------------------------------

    def submit(
        self,
        prompt: Seq[int],
        settings: RequestSettings,
        priority: float = 0.0,
        arrival_time: float | None = None,
    ) -> RequestHandle:
        """Queue a tokenized prompt; `arrival_time` (engine clock) defaults to now.

        A request the engine cannot serve (no tokens, an id outside the vocabulary, more
        tokens than its context limit, more pages than the pool) raises `RequestError` here,
        before it can reach a round: the engine and every other request go on as if it had
        never been submitted. (`RequestSettings` checks its own fields, max_new_tokens >= 1
        among them, when it is made.)"""
        prompt = self._checked_prompt(prompt)
        self._check_context(len(prompt), settings)
        self._check_pool_fits(len(prompt), settings)
        seq = self._new_sequence(prompt, settings, priority, arrival_time)
        seq.waiting_since = self.round
        self.submitted += 1
        self.live.append(seq)
        self._publish_stats()
        return RequestHandle(self, seq)

    def _checked_prompt(self, prompt: Seq[int]) -> list[int]:
        # The prompt as a list of token ids in the vocabulary (RequestError otherwise).
        prompt = list(prompt)
        if not prompt:
            raise RequestError("the prompt has no tokens; a request needs at least one")
        vocab = self.backend.vocab_size
        for i, token in enumerate(prompt):
            if isinstance(token, bool) or not isinstance(token, int | np.integer):
                raise RequestError(f"prompt token {i} is {token!r}; token ids are integers")
            if not 0 <= token < vocab:
                raise RequestError(
                    f"prompt token {i} is {token}; token ids must be in [0, {vocab})"
                )
        return prompt

    def _check_context(self, prompt_tokens: int, settings: RequestSettings) -> None:
        # RequestError for a request longer than the engine serves (its programs' work lists
        # are sized for rows of at most that many tokens: StepGeometry.max_seq_pages).
        need, limit = prompt_tokens + settings.max_new_tokens, self.backend.context_limit
        if need > limit:
            which = "max_context" if self.options.max_context else "the model's context"
            raise RequestError(
                f"prompt of {prompt_tokens} tokens + max_new_tokens={settings.max_new_tokens} "
                f"needs {need} positions but the engine's context is {limit} ({which})"
            )

    def _check_pool_fits(self, prompt_tokens: int, settings: RequestSettings) -> None:
        # RequestError for a request the whole pool could never hold. Its last burst starts
        # with one token to go and reserves pages for a whole burst.
        sps = self.options.steps_per_sync
        most = prompt_tokens + settings.max_new_tokens - 1 + sps
        need = pages_needed(most, self.options.page_size)
        if need > self.page_cache.num_pages - 1:
            raise RequestError(
                f"prompt of {prompt_tokens} tokens + max_new_tokens={settings.max_new_tokens} "
                f"needs {need} KV pages (with a burst of steps_per_sync={sps} to spare); "
                f"the pool has {self.page_cache.num_pages - 1}"
            )

    def _new_sequence(
        self,
        prompt: list[int],
        settings: RequestSettings,
        priority: float,
        arrival_time: float | None,
    ) -> Sequence:
        # The host's record of a checked request, its constraint's matcher registered.
        seq = Sequence(
            order=self.submitted,
            prompt=prompt,
            settings=settings,
            priority=priority,
            arrival_time=self.clock() if arrival_time is None else arrival_time,
            context=list(prompt),
            detokenizer=IncrementalDetokenizer(self.tokenizer) if self.tokenizer else None,
        )
        if settings.prompt_logprobs:  # filled as its chunks run (None: the first token)
            seq.output.prompt_logprobs = [None] * len(prompt)
        if settings.constraint is not None:
            if self.options.mesh_shape.size > 1:
                raise RequestError(
                    f"{settings.constraint[0]}: constrained output runs on one device "
                    f"(mesh 1x1), not on mesh {self.options.mesh}"
                )
            seq.grammar = register_grammar(
                *settings.constraint, self.tokenizer, self.backend.vocab_size
            )
        return seq

    def generate(
        self,
        prompts: Seq[Seq[int]],
        settings: Seq[RequestSettings],
        priorities: Seq[float] | None = None,
        on_text: Callable[[int, str], None] | None = None,
        on_done: Callable[[int, SequenceOutput], None] | None = None,
    ) -> list[SequenceOutput]:
        """Offline use: run every prompt to the end; outputs in order. Prompts are submitted
        in order within the feed window, so rounds stay short for any number of them;
        `on_text(i, piece)` receives prompt i's text as it is produced, `on_done(i, output)`
        each output as it completes."""
        handles: list[RequestHandle] = []

        def submit(i: int) -> list[RequestHandle]:
            priority = 0.0 if priorities is None else priorities[i]
            handles.append(self.submit(prompts[i], settings[i], priority))
            return [handles[i]]

        def stream(in_flight: list[tuple[int, list[RequestHandle]]]) -> None:
            for i, (handle,) in in_flight:
                for piece in handle.drain():
                    on_text(i, piece)

        def finished(i: int, done: list[RequestHandle]) -> None:
            if on_done is not None:
                on_done(i, done[0].output)

        run_fed(
            self,
            range(len(prompts)),
            submit,
            on_done=finished,
            on_round=stream if on_text is not None else None,
        )
        return [h.result() for h in handles]

    def run_until_idle(self) -> None:
        """Run rounds until every submitted request is done. While none of them has arrived
        yet (future `arrival_time`s), sleep until the first does instead of spinning; the
        clock is in seconds."""
        while self.step():
            now = self.clock()
            if self.live and all(s.arrival_time > now for s in self.live):
                time.sleep(max(min(s.arrival_time for s in self.live) - now, 0.0))

    # One round ----------------------------------------------------------------------------

    def step(self) -> bool:
        """Run one scheduler round; return whether unfinished work remains."""
        started = time.perf_counter()
        device = 0.0
        now = self.clock()
        self._time_last_round(now)
        live = self.live
        for seq in live:
            if seq.cancelled:
                self._release(seq)
                seq.close("cancelled")
                self._stamp_finish(seq, now)
        arrived = [s for s in live if not s.finished and s.arrival_time <= now]
        self._admit([s for s in arrived if s.status is Status.WAITING])
        # One ragged step: the decoding rows first (prefill never starves decode), then chunks
        # up to the token budget; with nothing to prefill, a K-step burst. (Pages for the
        # batch may preempt a prefilling sequence: list those after.)
        batch = self._pick_batch([s for s in arrived if s.status is Status.RUNNING])
        prefilling = [s for s in arrived if s.status is Status.PREFILLING]
        budget = self.options.token_budget - len(batch)
        drafts, forced = self._drafts(batch, budget)
        budget -= sum(len(d) for d in drafts)
        jobs = self._prefill_jobs(prefilling, budget)
        waits = self._prefill_waits(batch, jobs, verifies=any(drafts))
        if waits:
            jobs = []  # the batch bursts; the chunks come in a later round
        if jobs or any(drafts):
            device += self._mixed(batch, jobs, drafts, forced)
        elif batch:
            device += self._decode(batch)
        self._round_kind = "waited" if waits else "chunks" if jobs else None
        self.live = [s for s in self.live if not s.finished]
        self.round += 1
        self.device_seconds += device
        self.host_seconds += time.perf_counter() - started - device
        self._publish_stats()
        return bool(self.live)

    def _prefill_waits(
        self, batch: list[Sequence], jobs: list[tuple[Sequence, PrefillJob]], verifies: bool
    ) -> bool:
        # Whether this round's chunks wait for a burst of the batch: the policy's choice
        # within the scheduler's bound (scheduler.py, `prefill_waits`). A round that verifies
        # drafts is a ragged step anyway: its chunks never wait.
        if not jobs or verifies:
            self._waited_seconds = 0.0  # nothing is kept waiting
            return False
        waits = scheduler.prefill_waits(
            self.policy,
            batch,
            [(seq, len(job.tokens)) for seq, job in jobs],
            self.options.steps_per_sync,
            self._waited_seconds,
            self._chunk_seconds,
        )
        if not waits:
            self._waited_seconds = 0.0
        return waits

    def _time_last_round(self, now: float) -> None:
        # The last round's time on the engine's clock (from its start to this one's), kept
        # for the bound on waiting chunks: a round that ran chunks, or one they waited in.
        if self._round_kind == "chunks":
            self._chunk_seconds = now - self._round_started
        elif self._round_kind == "waited":
            self._waited_seconds += now - self._round_started
        self._round_started = now

    def _pick_batch(self, running: list[Sequence]) -> list[Sequence]:
        batch = scheduler.pick_batch(
            running,
            self.policy,
            self.round,
            self.options.max_batch_size,
            self.options.min_advance_rounds,
        )
        return self._reserve_burst_pages(batch, running)

    def _admit(self, waiting: list[Sequence]) -> None:
        opts = self.options
        resident = sum(s.status in (Status.PREFILLING, Status.RUNNING) for s in self.live)
        cache = self.page_cache
        for seq in scheduler.admission_order(waiting, self.policy, self.round):
            # The cached pages its context starts with; at least its last token is prefilled
            # (the first logits come from that chunk).
            # A sequence that still needs its prompt's log-probabilities prefills all of it.
            reuse = 0 if _prompt_targets(seq, 0, len(seq.prompt)) else len(seq.context) - 1
            found = cache.lookup(seq.context, reuse // opts.page_size)
            if found.pending:
                # An admitted sequence is prefilling the next page of this context: wait for
                # it (a round or a few) rather than compute the same page twice.
                continue
            need = pages_needed(len(seq.context) + opts.steps_per_sync, opts.page_size)
            need -= len(found.pages)
            if not self._room_for(need + found.idle, resident):
                break
            self._take_pages(seq, found.pages, need)
            seq.held = cache.publish(found.pages, seq.pages, seq.context)
            self._admitted(seq, Status.PREFILLING, len(found.pages) * opts.page_size)
            resident += 1

    def _room_for(self, cost: int, resident: int) -> bool:
        # Whether a sequence that takes `cost` pages out of the free count (new ones and
        # idle cached ones) can be admitted beside `resident` others: a free row, the pages,
        # and enough left for every resident sequence's next burst (an empty engine admits
        # whatever fits).
        burst_pages = pages_needed(self.options.steps_per_sync, self.options.page_size) + 1
        free = self.page_cache.num_free
        if not self.free_rows or free < cost:
            return False
        return free - cost >= resident * burst_pages or resident == 0

    def _take_pages(self, seq: Sequence, shared: list[CachedPage], new: int) -> None:
        # The sequence's page list: the cached pages it shares, then `new` of its own.
        self.page_cache.take(shared)
        seq.pages = [entry.page for entry in shared] + self.page_cache.allocate(new)

    def _admitted(self, seq: Sequence, status: Status, prefilled: int) -> None:
        # A row for `seq`, whose first `prefilled` context tokens its pages already hold.
        seq.row = self.free_rows.pop()
        seq.status, seq.prefilled = status, prefilled
        if seq.admitted_round < 0:
            seq.cached_tokens = prefilled
        seq.admitted_round = self.round
        if seq.admitted_time is None:
            seq.admitted_time = self.clock()

    def _prefill_jobs(
        self, prefilling: list[Sequence], budget: int
    ) -> list[tuple[Sequence, PrefillJob]]:
        # The next chunk of each admitted sequence, in the policy's prefill order (FCFS: oldest
        # admission first), within the token budget and `max_prefill_rows`.
        opts = self.options
        jobs = []
        for seq in scheduler.prefill_order(prefilling, self.policy, self.round):
            if len(jobs) == opts.max_prefill_rows or budget <= 0:
                break
            end = min(seq.prefilled + opts.prefill_chunk, len(seq.context), seq.prefilled + budget)
            chunk = seq.context[seq.prefilled : end]
            targets = _prompt_targets(seq, seq.prefilled, end)
            jobs.append((seq, PrefillJob(seq.row, chunk, seq.prefilled, seq.pages, targets)))
            budget -= len(chunk)
        return jobs

    def _drafts(self, batch: list[Sequence], budget: int) -> tuple[list[list[int]], list[bool]]:
        # What each row of the batch drafts this round (etjax/drafting), and whether it is a
        # forced run: a constrained row the tokens its grammar forces (forced.py); with
        # speculation on, the other rows, and a constrained row whose next token is free, by
        # prompt lookup (lengths by entropy and acceptance so far).
        spec = self.options.speculation
        drafts, forced = with_forced_drafts(
            self._lookup_drafts(batch, budget),
            [s.grammar for s in batch],
            [s.settings.max_new_tokens - len(s.output.token_ids) for s in batch],
            [s.drafts.acceptance if s.drafts else self.draft_pool.acceptance for s in batch],
            spec,
            self.options.steps_per_sync,
            budget,
            self.step_costs,
        )
        for seq, draft in zip(batch, drafts, strict=True):
            if draft and seq.drafts is None:  # a forced run, speculation off
                seq.drafts = DraftHistory(spec.acceptance_prior)
        return drafts, forced

    def _lookup_drafts(self, batch: list[Sequence], budget: int) -> list[list[int]]:
        # Speculation's drafts; none when it is off.
        spec = self.options.speculation
        if not spec.enabled:
            return [[] for _ in batch]
        for seq in batch:
            if seq.drafts is None:
                seq.drafts = DraftHistory(self.draft_pool.acceptance)
        # The signal: the calibrated entropy (the model's own without a calibration).
        signal = [s.output.calibrated_entropy for s in batch]
        entropies = [h[-1] if h else None for h in signal]
        histories = [s.drafts for s in batch]
        contexts = [s.history.view(s.prompt, s.output.token_ids) for s in batch]
        # The lookup's own evidence: a long matched tail is a copy under way, which drafts
        # whatever the last token's entropy (rule.py, `COPY_TAIL`). A batch too wide to
        # draft skips the lookups.
        tails = (
            [matched_tail(c, spec.ngram_max) for c in contexts]
            if len(batch) < spec.draft_budget
            else None
        )
        lengths = draft_lengths(
            entropies, histories, spec, budget, self.draft_pool, costs=self.step_costs, tails=tails
        )
        # The lookup continues the committed text, so its first token predicts the one the
        # device samples this step; the drafts are what follows that prediction. A
        # constrained row's are cut where its grammar would refuse them.
        drafts = []
        for seq, context, n in zip(batch, contexts, lengths, strict=True):
            # A row whose token is pending (its first, drawn when it was made and streamed)
            # runs that token this step instead of drawing one: its drafts follow it, so
            # they are the lookup itself. Its first round may then verify rather than burst
            # (on a copy, 7 drafts where 8 steps made 8 tokens).
            own = 0 if seq.token_pending else 1
            lookup = lookup_draft(context, n + own, spec.ngram_max, spec.ngram_min) if n else []
            if seq.grammar >= 0:
                drafts.append(lookup_within_grammar(seq.grammar, lookup) if lookup else [])
            else:
                drafts.append(lookup[own:])
        return drafts

    def _mixed(
        self,
        batch: list[Sequence],
        jobs: list[tuple[Sequence, PrefillJob]],
        drafts: list[list[int]],
        forced: list[bool],
    ) -> float:
        # One ragged step: the batch's rows decode a token each (and verify their drafts),
        # the jobs append their chunks.
        order = sorted(range(len(batch)), key=lambda i: batch[i].row)
        batch, drafts = [batch[i] for i in order], [drafts[i] for i in order]
        forced = [forced[i] for i in order]
        compiled = self._compiles()
        started = time.perf_counter()
        out, budgets, costs, prompt_logprobs = self.backend.mixed(
            [s.row for s in batch],
            [s.pages for s in batch],
            [s.cache_length for s in batch],
            [s.budget for s in batch],
            [job for _, job in jobs],
            drafts if any(drafts) else None,
        )
        elapsed = time.perf_counter() - started
        ran = _ran_pending(batch, out)
        committed = np.asarray(out.emitted).sum(axis=0) if batch else None
        if batch:
            # A row that ran a pending token committed its accepted drafts only.
            committed = committed + np.asarray(ran, np.int64)
        if batch and not jobs and any(drafts) and self._measured(compiled):
            # A verifying step alone (the host arrays it returns are on the host: the
            # device is done), for the cost gate, with the drafted positions it checked:
            # while some row still accepted (etjax/runtime/verify.py).
            checked = max(min(int(c), len(d)) for c, d in zip(committed, drafts, strict=True) if d)
            self.step_costs.record_verify(len(batch), sum(map(len, drafts)), checked, elapsed)
        if batch:
            self.decode_rounds += 1
            self.decode_bursts += 1
            self.model_passes += 1
            if any(drafts):
                self._record_drafts(batch, drafts, forced, committed)
            self._collect(batch, out, budgets, one_pass=True, ran=ran)
        for (seq, job), (flops, nbytes), values in zip(jobs, costs, prompt_logprobs, strict=True):
            if values is not None:
                _record_prompt_logprobs(seq, job, values)
            self._prefilled(seq, seq.prefilled + len(job.tokens), flops, nbytes)
        if self._drawing:
            self._collect_first()
        return elapsed

    def _collect_first(self) -> None:
        # The first tokens the sequences made resident in this round drew from their
        # prompts' logits (`RowInit.draw`), streamed now, when the step that ran the
        # prompts' last chunks returns; a sequence they did not finish holds its token
        # pending (its next step runs it, and counts the pass).
        seqs, self._drawing = self._drawing, []
        out, budgets = self.backend.first_tokens([s.row for s in seqs])
        self._collect(seqs, out, budgets, drawn=True)
        for seq in seqs:
            seq.token_pending = not seq.finished
        if any(seq.finished for seq in seqs):  # as the decode step that drew it would
            self.model_passes += 1

    def _record_drafts(
        self,
        batch: list[Sequence],
        drafts: list[list[int]],
        forced: list[bool],
        committed: np.ndarray,
    ) -> None:
        # The step's verdicts: a row committed its token and the drafts it accepted.
        rows = [j for j, d in enumerate(drafts) if d]
        record_verification(
            [batch[j].drafts for j in rows],
            [len(drafts[j]) for j in rows],
            [max(int(committed[j]) - 1, 0) for j in rows],
            [not forced[j] for j in rows],
            self.draft_pool,
            self.options.speculation,
        )

    def _prefilled(self, seq: Sequence, end: int, flops: float, nbytes: float) -> None:
        # A chunk of `seq` is cached up to `end`; a finished context makes it resident.
        seq.prefilled = end
        self.page_cache.mark_written(seq.held, end)
        seq.recompute_flops += flops
        seq.recompute_bytes += nbytes
        if end < len(seq.context):
            return
        forks = self._fork_waiting(seq)  # before its insert: they take its last logits
        for resident in (seq, *forks):
            self._make_resident(resident)

    def _fork_waiting(self, seq: Sequence) -> list[Sequence]:
        # Waiting sequences whose context is the one `seq` just finished prefilling (the n
        # samples of one prompt, the same question asked twice) start from its result instead
        # of prefilling: its full pages shared, a copy of its partly filled last page, its
        # last logits. Without the fork each would prefill at least its last page again.
        opts, cache = self.options, self.page_cache
        context = seq.context
        full = len(context) // opts.page_size
        partial = len(context) % opts.page_size != 0
        now = self.clock()
        resident = sum(s.status in (Status.PREFILLING, Status.RUNNING) for s in self.live)
        forks = []
        for other in self.live:
            if (
                other.status is not Status.WAITING
                or other.cancelled
                or other.arrival_time > now
                or other.context != context
                or _prompt_targets(other, 0, len(context))
            ):
                continue
            found = cache.lookup(context, full)
            if len(found.pages) < full:
                break  # its pages are not all indexed (the cache is off, or it lost a race)
            need = pages_needed(len(context) + opts.steps_per_sync, opts.page_size) - full
            if not self._room_for(need + found.idle, resident):
                break
            self._take_pages(other, found.pages, need)
            other.held = list(found.pages)
            self._admitted(other, Status.PREFILLING, len(context))
            copy = (seq.pages[full], other.pages[full]) if partial else None
            self.backend.fork(seq.row, other.row, other.pages, copy)
            resident += 1
            forks.append(other)
        return forks

    def _make_resident(self, seq: Sequence) -> None:
        # Its context is cached: its row takes the sequence's state and it decodes from now.
        # A new one draws its first token at once (streamed when the round's step returns:
        # `_collect_first`), unless it has a grammar (whose matcher the host advances with
        # each token in a step: it draws in its first decode step, as a preempted sequence
        # back from its recompute does).
        draw = self.backend.draws_first_tokens and seq.saved_row is None and seq.grammar < 0
        if draw:
            self._drawing.append(seq)
        self.backend.insert(
            seq.row,
            RowInit(
                prompt=seq.prompt,
                generated=list(seq.output.token_ids),
                settings=seq.settings,
                saved=seq.saved_row,
                prefill_flops=seq.recompute_flops,
                prefill_bytes=seq.recompute_bytes,
                grammar=seq.grammar,
                draw=draw,
            ),
        )
        seq.saved_row, seq.recompute_flops, seq.recompute_bytes = None, 0.0, 0.0
        seq.status = Status.RUNNING
        seq.resident_round = seq.last_run_round = self.round  # the advancement clock

    def _reserve_burst_pages(
        self, batch: list[Sequence], running: list[Sequence]
    ) -> list[Sequence]:
        # Every sequence in the batch needs pages up to its length after the burst. When the
        # pool is short, the least valuable resident sequence is preempted, batch members last.
        opts = self.options
        kept = []
        for seq in sorted(batch, key=lambda s: -self.policy.run_priority(s, self.round)):
            if seq.status is not Status.RUNNING:
                continue  # preempted for an earlier member
            need = pages_needed(seq.cache_length + opts.steps_per_sync, opts.page_size)
            need -= len(seq.pages)
            while need > self.page_cache.num_free:
                resident = [s for s in self.live if s.status in (Status.PREFILLING, Status.RUNNING)]
                victim = scheduler.preemption_victim(
                    resident, self.policy, self.round, protect=[*kept, seq]
                )
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is Status.RUNNING and need > 0:
                seq.pages += self.page_cache.allocate(need)
            if seq.status is Status.RUNNING:
                kept.append(seq)
        return sorted(kept, key=lambda s: s.row)

    def _preempt(self, seq: Sequence) -> None:
        if seq.status is Status.RUNNING:
            seq.saved_row = self.backend.save(seq.row)
            seq.context = seq.prompt + list(seq.output.token_ids)
        # A sequence still prefilling restarts its context from scratch (and a pending token
        # is part of the context its recompute caches).
        self._release(seq)
        seq.status, seq.prefilled, seq.token_pending = Status.WAITING, 0, False
        seq.preemptions += 1
        self.preemptions += 1
        seq.waiting_since = self.round

    def _release(self, seq: Sequence) -> None:
        if seq.pages:
            # What its pages hold: a prefilling sequence its prefilled context; a resident
            # one every token it sampled but perhaps the last (a step samples a token and runs
            # the model on it, except on a token that finishes the row).
            tokens = seq.prompt + list(seq.output.token_ids)
            written = seq.prefilled
            if seq.status is Status.RUNNING:
                written = max(written, seq.length - 1)
            self.page_cache.release(seq.held, seq.pages, tokens, written)
            seq.pages, seq.held = [], []
        if seq.row >= 0:
            self.backend.release(seq.row)
            self.free_rows.append(seq.row)
            seq.row = -1

    def _decode(self, batch: list[Sequence]) -> float:
        # Rows of very different attention widths run as separate bursts when that reads
        # fewer bytes (grouping.py); every row of the batch still advances this round.
        estimate = self.backend.burst_cost
        groups = split_by_width(
            batch,
            lambda s: estimate.row_width(s.length, s.budget),
            lambda g: estimate.burst_bytes([s.length for s in g], [s.budget for s in g]),
            self.options.max_batch_groups,
        )
        self.decode_rounds += 1
        return sum(self._decode_burst(sorted(g, key=lambda s: s.row)) for g in groups)

    def _decode_burst(self, batch: list[Sequence]) -> float:
        compiled = self._compiles()
        started = time.perf_counter()
        out, budgets, spared = self.backend.decode(
            [s.row for s in batch],
            [s.pages for s in batch],
            [s.cache_length for s in batch],
            [s.budget for s in batch],
            max(s.settings.max_new_tokens - len(s.output.token_ids) for s in batch),
        )
        elapsed = time.perf_counter() - started
        ran_pending = _ran_pending(batch, out, spared)  # its first step ran their tokens
        self.decode_bursts += 1
        ran = np.any(out.emitted, axis=1)  # steps in which a row got a token
        ran[0] |= any(ran_pending)  # or ran a pending one (a token of the burst's rows)
        self.model_passes += int(ran.sum())
        steps = self.options.steps_per_sync
        if ran.sum() == steps and self._measured(compiled):  # a whole burst
            self.step_costs.record_burst(len(batch), elapsed / steps)
        self._collect(batch, out, budgets, spared=spared, ran=ran_pending)
        return elapsed

    def _compiles(self) -> int | None:
        # JAX's compile events so far, while the engine measures its steps (None when not).
        return None if self.step_costs is None else compile_events()

    def _measured(self, compiled_before: int | None) -> bool:
        # Whether the device call just made is a sample of its step's cost: the engine
        # measures, and nothing was traced or compiled during it.
        return compiled_before is not None and compile_events() == compiled_before

    def _collect(
        self,
        batch: list[Sequence],
        out,
        budgets,
        one_pass: bool = False,
        spared=None,
        ran: list[bool] | None = None,
        drawn: bool = False,
    ) -> None:
        # Stream the rows' new tokens [steps, rows], apply stops, free finished sequences.
        # `one_pass`: the steps are one model pass (a token and its verified drafts), not K.
        # `spared`: the blocks a step read once for its shared-prefix group, per row [rows] or
        # per step and row [K, rows]. `ran` [rows]: whose pending token the first step ran
        # (its pass is counted here: it gave the sequence that token). `drawn`: first tokens
        # drawn with the prompt, whose passes are still to run (counted then; one that ends
        # its sequence is never run and counts as the decode step that drew it would).
        now = self.clock()
        trace_columns = [getattr(out, name) for name in TRACE_FIELDS.values()]
        for j, seq in enumerate(batch):
            seq.last_run_round = self.round
            seq.budget = float(budgets[j])
            emitted_steps = int(np.count_nonzero(out.emitted[:, j]))
            passes = emitted_steps + (ran is not None and ran[j])
            seq.decode_passes += 0 if drawn else min(passes, 1) if one_pass else passes
            produced = 0
            for k in np.nonzero(out.emitted[:, j])[0]:
                trace = tuple(columns[k, j].item() for columns in trace_columns)
                produced += 1
                seq.token_times.append(now)
                if seq.first_token_time is None:
                    seq.first_token_time = now
                finish = FINISH_REASONS[out.finish[k, j]]
                if seq.settings.logprobs:
                    width = seq.settings.logprobs
                    pairs = zip(
                        out.top_ids[k, j, :width].tolist(),
                        out.top_logprobs[k, j, :width].tolist(),
                        strict=True,
                    )
                    if seq.output.top_logprobs is None:
                        seq.output.top_logprobs = []
                    # Only tokens the distribution allows: under a constraint the top k pad
                    # with forbidden ones at -inf (which JSON cannot hold).
                    seq.output.top_logprobs.append([p for p in pairs if p[1] != -np.inf])
                saved = 0.0 if spared is None else spared[j] if spared.ndim == 1 else spared[k, j]
                seq.output.shared_blocks.append(float(saved))
                if not seq.accept(int(out.tokens[k, j]), trace, finish):
                    break
            self.policy.observe(seq, produced)
            self.tokens_generated += produced
            if drawn and seq.output.finish_reason:  # no pass is to run it: the draw's counts
                seq.decode_passes += 1
            if seq.output.finish_reason:
                self._release(seq)
                seq.close()
                if seq.grammar >= 0:
                    _check_constraint(seq)
                self._stamp_finish(seq, now)

    def _stamp_finish(self, seq: Sequence, now: float) -> None:
        if seq.grammar >= 0:
            release_grammar(seq.grammar)
        seq.finish_time, seq.finish_round = now, self.round
        self.finished += 1
        out, n = seq.output, len(seq.output.token_ids)
        out.metrics = {
            "arrival_time": seq.arrival_time,
            "queue_time": (seq.admitted_time or now) - seq.arrival_time,
            "time_to_first_token": (seq.first_token_time or now) - seq.arrival_time,
            "end_to_end_latency": now - seq.arrival_time,
            "per_token_latency": (now - seq.first_token_time) / (n - 1)
            if n > 1 and seq.first_token_time is not None
            else 0.0,
            "generated_tokens": float(n),
            "prompt_tokens": float(len(seq.prompt)),
            "cached_tokens": float(seq.cached_tokens),  # of them, served by the prefix cache
            "preemptions": float(seq.preemptions),
            # Drafts (speculation's lookups, a grammar's forced runs), counted: the decode
            # passes that gave it tokens (burst steps and ragged steps, verifying or not;
            # prefill not counted), tokens drafted, drafts accepted, and the passes that
            # verified drafts. Without a stop string cutting a pass's tokens,
            # generated_tokens = model_passes + accepted_tokens. Then as ratios: passes per
            # generated token (1 without drafts), the fraction of drafts accepted, and the
            # drafts a verifying pass accepted on average.
            "model_passes": float(seq.decode_passes),
            "drafted_tokens": float(seq.drafts.drafted) if seq.drafts else 0.0,
            "accepted_tokens": float(seq.drafts.accepted) if seq.drafts else 0.0,
            "verify_steps": float(seq.drafts.verify_steps) if seq.drafts else 0.0,
            "passes_per_token": seq.decode_passes / n if n else 0.0,
            "acceptance_rate": seq.drafts.accepted / seq.drafts.drafted
            if seq.drafts and seq.drafts.drafted
            else 0.0,
            "mean_accepted_length": seq.drafts.accepted / seq.drafts.verify_steps
            if seq.drafts and seq.drafts.verify_steps
            else 0.0,
            "tau": out.tau[-1] if out.tau else 0.0,
            "cost_bytes": out.cost_bytes[-1] if out.cost_bytes else 0.0,
            "cost_flops": out.cost_flops[-1] if out.cost_flops else 0.0,
        }

    @property
    def feed_window(self) -> int:
        """How many unfinished requests a feeder with many to submit (generate_ids, a batch
        job) keeps in the engine: enough that admission never runs dry (4 per resident row),
        few enough that a round's scans stay short whatever the size of the input."""
        return FEED_PER_ROW * self.options.resident_rows

    # Accounting ---------------------------------------------------------------------------

    @property
    def pages_in_use(self) -> int:
        """Pages live sequences hold (cached pages nobody holds are not in use)."""
        return self.page_cache.num_held

    def stats(self) -> EngineStats:
        """The engine's load as of its last round or submission. Safe from any thread
        without a lock: the engine thread builds a new snapshot and swaps it in whole."""
        return self._stats

    def _publish_stats(self) -> None:
        waiting = prefilling = running = 0
        for seq in self.live:
            if seq.status is Status.RUNNING:
                running += 1
            elif seq.status is Status.PREFILLING:
                prefilling += 1
            elif seq.status is Status.WAITING and not seq.cancelled:
                waiting += 1
        cache = self.page_cache
        self._stats = EngineStats(
            waiting=waiting,
            prefilling=prefilling,
            running=running,
            kv_pages_used=cache.num_held,
            kv_pages_free=cache.num_free,
            kv_pages_total=cache.num_pages - 1,
            submitted=self.submitted,
            finished=self.finished,
            tokens_generated=self.tokens_generated,
            preemptions=self.preemptions,
            rounds=self.round,
            model_passes=self.model_passes,
        )


def _check_constraint(seq: Sequence) -> None:
    # A constrained output llguidance failed on (or that ended where its grammar was not
    # complete) finishes as "error", never as "eos": after a failure its mask allows only
    # end-of-sequence, and "eos" under a constraint means that the output satisfies it.
    why = grammar_failure(seq.grammar, seq.output.finish_reason)
    if why is not None:
        seq.output.finish_reason = "error"
        seq.output.error = f"{seq.settings.constraint[0]}: {why}"


def _ran_pending(batch: list[Sequence], out, spared=None) -> list[bool]:
    # After a step over `batch` (outputs [K, rows]; `spared` as `_collect` takes it): the
    # pending tokens ran in its first step, whose outputs report for them what their pass
    # read and cost (the blocks it kept, the cost after it, the blocks its group read once),
    # which the draw of the token could not know (etjax/runtime/steps.py `first_token`):
    # their traces get it, as a step that drew and ran a token gives it. Returns, per row,
    # whether it held one.
    pending = [seq.token_pending for seq in batch]
    for j, seq in enumerate(batch):
        if not seq.token_pending:
            continue
        seq.token_pending, trace = False, seq.output
        trace.kept_blocks[-1] = out.kept_blocks[0, j].item()
        trace.cost_flops[-1] = out.cost_flops[0, j].item()
        trace.cost_bytes[-1] = out.cost_bytes[0, j].item()
        if spared is not None:
            trace.shared_blocks[-1] = float(spared[j] if spared.ndim == 1 else spared[0, j])
    return pending


def _prompt_targets(seq: Sequence, start: int, end: int) -> list[int] | None:
    # What a chunk of context [start, end) asks for prompt log-probabilities: at each position
    # p the prompt token p + 1, where its value is still missing (a recomputed context after
    # a preemption asks for nothing); -1 elsewhere. None when nothing is asked.
    if not seq.settings.prompt_logprobs:
        return None
    prompt, done = seq.prompt, seq.output.prompt_logprobs
    targets = [
        prompt[p + 1] if p + 1 < len(prompt) and done[p + 1] is None else -1
        for p in range(start, end)
    ]
    return targets if any(t >= 0 for t in targets) else None


def _record_prompt_logprobs(seq: Sequence, job: PrefillJob, values: np.ndarray) -> None:
    # Prompt token p + 1's log-probability is what position p's logits give it.
    for i, target in enumerate(job.targets):
        if target >= 0:
            seq.output.prompt_logprobs[job.start + i + 1] = float(values[i])
