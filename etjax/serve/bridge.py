"""`EngineBridge`: the engine on a thread of its own, fed by the server through a queue.

The engine's host loop is plain single-threaded Python (etjax/engine/engine.py), and the
server's event loop must never wait for a device step. So one thread owns the engine and
everything in it: between rounds it takes submissions and cancellations from a thread-safe
queue (a request joins the continuous batch at the next round), runs rounds while anything is
live, and hands each request's new output to the event loop that asked for it
(`loop.call_soon_threadsafe`) as copies, so the server never reads an engine object while the
engine changes it. With nothing live it sleeps on the queue, and wakes to the requests
sent together, not the first alone (`ARRIVAL_GAP`).

Back-pressure: at most the engine's resident rows plus `max_waiting` samples are in flight;
past that `open` refuses at once (429), before anything is queued. A cancelled request (its
client went away) has its pages released at the next round, which starts at once; a request
past its deadline is cancelled the same way and answered 504.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field

from etjax.engine.engine import Engine, OutputDelta, RequestHandle
from etjax.errors import RequestError
from etjax.runtime.options import DRAFT_COUNTS, SequenceOutput
from etjax.serve.body import ServeRequest
from etjax.serve.errors import ApiError
from etjax.serve.metrics import Metrics

log = logging.getLogger("etjax")

# An idle engine's first round waits for requests arriving less than ARRIVAL_GAP after the
# last one, GATHER_LIMIT in all at most: a lone request's first token comes ARRIVAL_GAP
# later (under 2% of a SmolLM2 prefill round on a 2-core CPU).
ARRIVAL_GAP, GATHER_LIMIT = 0.001, 0.02  # seconds


@dataclass
class Delta:
    """One sample's new output since its last delta; `finish_reason` is set on its last
    ("eos", "stop", "length", or "error"), with `output`, the engine's whole record of it."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None
    trace: dict[str, list[float]]  # a trace field (TRACE_FIELDS) -> the new tokens' values
    finish_reason: str | None = None
    output: SequenceOutput | None = None


@dataclass
class Failure:
    """The request failed as a whole (a refusal by the engine, its timeout, shutdown)."""

    error: ApiError


@dataclass(eq=False)
class Ticket:
    """A request in flight: the server waits on `events`, the engine thread fills it with
    lists of `Delta`s (an empty one once the engine took it, then one per round that produced
    something) or a `Failure`."""

    request: ServeRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    arrival: float
    deadline: float
    handles: list[RequestHandle] = field(default_factory=list)
    last_time: list[float | None] = field(default_factory=list)  # of each sample's last token
    done: list[bool] = field(default_factory=list)

    @property
    def samples(self) -> int:
        return len(self.request.samples)


class EngineBridge:
    """Owns `engine` on a thread of its own (module docstring); `open` and `cancel` are the
    server's side, called from its event loop."""

    def __init__(
        self,
        engine: Engine,
        metrics: Metrics,
        max_waiting: int,
        request_timeout: float,
    ) -> None:
        self.engine, self.metrics = engine, metrics
        self.capacity = engine.options.resident_rows + max_waiting
        self.request_timeout = request_timeout
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._in_flight = 0  # samples opened and not yet finished or cancelled
        self._tickets: list[Ticket] = []  # the engine thread's own
        self._stopping = False
        self.broken = False  # the engine thread died of a bug: nothing is answered any more
        self._thread = threading.Thread(target=self._run, name="etjax-engine", daemon=True)

    # The server's side ---------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def open(self, request: ServeRequest) -> Ticket:
        """Queue a request for the engine (from the event loop that will read its events);
        `ApiError` 429 when the queue is full, 503 once the server is stopping."""
        n = len(request.samples)
        with self._lock:
            if self._stopping:
                raise ApiError(503, "the server is shutting down", code="server_shutting_down")
            if self.broken:
                raise ApiError(503, "the engine thread failed; see the server's log")
            if self._in_flight + n > self.capacity:
                self.metrics.outcome("rejected")
                raise ApiError(
                    429,
                    f"the server's queue is full ({self._in_flight} samples in flight, "
                    f"{self.capacity} at most); retry later",
                    code="queue_full",
                    headers={"Retry-After": "1"},
                )
            self._in_flight += n
        now = time.monotonic()
        ticket = Ticket(
            request,
            asyncio.get_running_loop(),
            asyncio.Queue(),
            arrival=now,
            deadline=now + self.request_timeout,
        )
        self._inbox.put(("submit", ticket))
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """Stop generating for `ticket` (its client went away); its pages are released at the
        engine's next round. Harmless after it finished."""
        self._inbox.put(("cancel", ticket))

    def stop(self, timeout: float = 30.0) -> None:
        """Refuse new requests, fail those still in flight (503) and end the thread."""
        with self._lock:
            self._stopping = True
        self._inbox.put(("stop", None))
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    # The engine thread -----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                if not self._take_commands(wait=not self._tickets):
                    break
                if self.engine.live:
                    self._step()
                now = time.monotonic()
                for ticket in list(self._tickets):
                    self._deliver(ticket, now)
        except Exception:  # a bug in this loop: nothing would answer again, so say so
            log.exception("the engine thread failed; the server answers 503 from now on")
            with self._lock:
                self.broken = True
            for ticket in list(self._tickets):
                self._fail(ticket, ApiError(500, "the engine thread failed"), "error")
            return
        for ticket in list(self._tickets):
            self._fail(ticket, ApiError(503, "the server is shutting down"), "error")
        if self.engine.live:  # release the cancelled requests' pages
            self.engine.step()

    def _take_commands(self, wait: bool) -> bool:
        # Everything queued; False on "stop". When idle, wait for the first command, then
        # gather the ones right behind it (`_next_command`).
        try:
            command = self._inbox.get(block=wait)
        except queue.Empty:
            return True
        gather_until = time.monotonic() + GATHER_LIMIT if wait else 0.0
        while True:
            kind, ticket = command
            if kind == "stop":
                return False
            if kind == "submit":
                self._submit(ticket)
            elif kind == "cancel" and ticket in self._tickets:
                self._drop(ticket, "cancelled")
            command = self._next_command(gather_until)
            if command is None:
                return True

    def _next_command(self, gather_until: float):
        # The next queued command, or None. Until `gather_until`, also one that arrives
        # within ARRIVAL_GAP: requests sent together reach the event loop a fraction of a
        # millisecond apart, and an idle engine that started on the first alone would
        # prefill it in a round of its own, the rest in the next, each row of the batch then
        # one round behind the other: 16 requests sent at once took 11 rounds, where
        # decode() takes 10 (docs/PERF.md, the serve table's (a)).
        gap = min(ARRIVAL_GAP, gather_until - time.monotonic())
        try:
            return self._inbox.get(timeout=gap) if gap > 0 else self._inbox.get_nowait()
        except queue.Empty:
            return None

    def _submit(self, ticket: Ticket) -> None:
        request = ticket.request
        try:
            for settings in request.samples:
                ticket.handles.append(
                    self.engine.submit(request.prompt_ids, settings, request.priority)
                )
        except Exception as e:  # a refusal (RequestError), or a failure of this request alone
            if not isinstance(e, RequestError):
                log.exception("a request could not be submitted")
            error = ApiError(400, str(e)) if isinstance(e, RequestError) else ApiError(500, str(e))
            for handle in ticket.handles:
                handle.cancel()
            self._release(ticket)
            self._send(ticket, Failure(error))
            self.metrics.outcome("error")
            return
        n = ticket.samples
        ticket.last_time, ticket.done = [None] * n, [False] * n
        self._tickets.append(ticket)
        self.metrics.add(prompt_tokens=len(request.prompt_ids))
        self._send(ticket, [])  # accepted: the server may answer 200 now

    def _step(self) -> None:
        started = time.perf_counter()
        try:
            self.engine.step()
        except Exception:  # a bug, not a request's fault: fail what is in flight, go on
            log.exception("an engine round failed; failing the requests in flight")
            for ticket in list(self._tickets):
                self._fail(
                    ticket, ApiError(500, "the engine failed; see the server's log"), "error"
                )
            return
        self.metrics.observe("step_seconds", time.perf_counter() - started)

    def _deliver(self, ticket: Ticket, now: float) -> None:
        # Each sample's new output since the last round (the handles' deltas: copies).
        if now > ticket.deadline:
            seconds = self.request_timeout
            self._fail(
                ticket, ApiError(504, f"the request took longer than {seconds:g} s"), "timeout"
            )
            return
        deltas = []
        for i, handle in enumerate(ticket.handles):
            new = None if ticket.done[i] else handle.delta()
            if new is None:
                continue
            finished = new.finish_reason is not None
            deltas.append(_delta(i, new, handle.output if finished else None))
            self._time_tokens(ticket, i, len(new.token_ids), now)
            if finished:
                ticket.done[i] = True
                self._finished_sample(ticket, handle.output, now)
        if deltas:
            self._send(ticket, deltas)
        if all(ticket.done):
            self._tickets.remove(ticket)
            self._release(ticket)
            failed = any(h.output.finish_reason == "error" for h in ticket.handles)
            self.metrics.outcome("error" if failed else "ok")

    def _time_tokens(self, ticket: Ticket, i: int, count: int, now: float) -> None:
        # A round's tokens reach the client together: the gap since the sample's last tokens
        # is spread over them.
        if count == 0:
            return
        last = ticket.last_time[i]
        if last is None:
            self.metrics.observe("time_to_first_token_seconds", now - ticket.arrival)
            if count > 1:
                self.metrics.observe("inter_token_latency_seconds", *[0.0] * (count - 1))
        else:
            self.metrics.observe("inter_token_latency_seconds", *[(now - last) / count] * count)
        ticket.last_time[i] = now

    def _finished_sample(self, ticket: Ticket, out: SequenceOutput, now: float) -> None:
        prompt = len(ticket.request.prompt_ids)
        page = self.engine.options.page_size
        self.metrics.observe("e2e_request_latency_seconds", now - ticket.arrival)
        self.metrics.add(
            prefix_cache_queries=prompt,
            prefix_cache_hits=out.metrics.get("cached_tokens", 0.0),
            **{name: out.metrics.get(name, 0.0) for name in DRAFT_COUNTS},
        )
        self.metrics.observe("token_entropy_nats", *out.entropy)
        # Blocks read after drawing token i over the blocks its context then spans; a token
        # whose pass was skipped (its row had finished) read none and is left out.
        fractions = [
            min(kept / math.ceil((prompt + i + 1) / page), 1.0)
            for i, kept in enumerate(out.kept_blocks)
            if kept > 0
        ]
        self.metrics.observe("kept_fraction", *fractions)

    def _fail(self, ticket: Ticket, error: ApiError, outcome: str) -> None:
        self._drop(ticket, outcome)
        self._send(ticket, Failure(error))

    def _drop(self, ticket: Ticket, outcome: str) -> None:
        for handle in ticket.handles:
            handle.cancel()  # released at the next round
        self._tickets.remove(ticket)
        self._release(ticket)
        self.metrics.outcome(outcome)

    def _release(self, ticket: Ticket) -> None:
        with self._lock:
            self._in_flight -= ticket.samples

    def _send(self, ticket: Ticket, event: list[Delta] | Failure) -> None:
        # A closed event loop (RuntimeError) has nobody waiting any more.
        with contextlib.suppress(RuntimeError):
            ticket.loop.call_soon_threadsafe(ticket.events.put_nowait, event)


def _delta(index: int, new: OutputDelta, output: SequenceOutput | None) -> Delta:
    return Delta(
        index=index,
        text=new.text,
        token_ids=new.token_ids,
        logprobs=new.trace["logprob"],
        top_logprobs=new.top_logprobs,
        trace=new.trace,
        finish_reason=new.finish_reason,
        output=output,
    )
