"""The server's engine hooks and its page accounting under disconnects, on the mock engine.

`etjax serve`'s application runs in this process on uvicorn (a thread), over an engine bridge
whose engine is the hand-computable mock of tests/engine_mock.py, with a stub tokenizer that
writes token t as " t": every stream's text is known in advance (request r's i-th token is
`token_of(r, i)`), and the mock checks page ownership as it runs. No model is loaded, so the
module runs in seconds.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass

import httpx2
import pytest
import uvicorn

from etjax.request_fields import RequestSettings
from etjax.run_config import load_run_config
from etjax.serve.app import make_app
from etjax.serve.bridge import EngineBridge
from etjax.serve.limits import ServeLimits
from etjax.serve.metrics import Metrics
from etjax.serve.state import READY, ServerState
from tests.engine_mock import K, mock_engine, serve_request, token_of

REQUESTS, DISCONNECTS = 200, 50
MAX_TOKENS = 6  # a complete request's tokens
LONG = 2000  # a disconnecting request's max_tokens: it is still generating when it goes


class _Backend:
    # What IncrementalDetokenizer reads: token t is the text " t".
    @staticmethod
    def decode(ids, skip_special_tokens=False) -> str:
        return "".join(f" {t}" for t in ids)


class StubTokenizer:
    """Prompt "r" is the mock's request r ([r, 5, 6]); token t reads " t"."""

    backend = _Backend()
    vocab_size = 1000
    eos_token_id = 2

    def encode(self, text: str) -> list[int]:
        return [int(text), 5, 6]

    def decode(self, ids, skip_special_tokens=False) -> str:
        return _Backend.decode(ids)


@dataclass(frozen=True)
class _Config:
    max_position_embeddings: int = 4096


class StubModel:
    """What the routes read of a model: its name, tokenizer and context."""

    name = "mock"
    tokenizer = StubTokenizer()
    config = _Config()


class ReadyState(ServerState):
    """A state whose model is already there: the app's startup loads nothing."""

    def load(self, on_failure) -> None:
        return None


def _expected_text(request_id: int, n: int) -> str:
    return "".join(f" {token_of(request_id, i)}" for i in range(n))


# The engine's hooks -------------------------------------------------------------------------


def test_a_handle_delta_is_each_rounds_new_output_once():
    engine, _ = mock_engine(batch=2)
    engine.tokenizer = StubTokenizer()
    handle = engine.submit([7, 5, 6], RequestSettings(max_new_tokens=5, ignore_eos=True))
    assert handle.delta() is None  # nothing yet
    tokens, text, finish = [], "", None
    while not handle.done:
        engine.step()
        new = handle.delta()
        if new is None:
            continue
        assert len(new.token_ids) <= K  # a burst's worth at most
        assert all(len(v) == len(new.token_ids) for v in new.trace.values())
        tokens += new.token_ids
        text += new.text
        finish = new.finish_reason
    assert tokens == [token_of(7, i) for i in range(5)]
    assert text == _expected_text(7, 5)
    assert finish == "length"
    assert handle.delta() is None  # the last delta was handed over


def test_engine_stats_count_the_queue_the_pages_and_the_tokens():
    engine, _ = mock_engine(batch=2, resident=2, pages=64)
    start = engine.stats()
    assert (start.waiting, start.running, start.kv_pages_used) == (0, 0, 0)
    assert start.kv_pages_free == start.kv_pages_total == 63
    settings = RequestSettings(max_new_tokens=4, ignore_eos=True)
    handles = [engine.submit([r, 5, 6], settings) for r in (1, 2, 3)]
    assert engine.stats().waiting == 3  # a submission is counted at once
    engine.step()  # 2 resident rows: two admitted (prefilled in this round), one waits
    stats = engine.stats()
    assert (stats.waiting, stats.prefilling + stats.running) == (1, 2)
    # Each holds the pages of its 3 prompt tokens and a burst of K = 2: 2 pages of 4.
    assert stats.kv_pages_used == 4 and stats.kv_pages_free == 63 - 4
    while engine.step():
        pass
    end = engine.stats()
    assert all(h.done for h in handles)
    assert (end.waiting, end.running, end.kv_pages_used) == (0, 0, 0)
    assert end.kv_pages_free == 63
    assert (end.submitted, end.finished, end.tokens_generated) == (3, 3, 12)


# 200 streams, 50 of which go away mid-stream --------------------------------------------------


@pytest.fixture
def served():
    engine, backend = mock_engine(batch=8, resident=16, pages=1024)
    engine.tokenizer = StubTokenizer()
    limits = ServeLimits(max_tokens=LONG, max_waiting=REQUESTS)
    metrics = Metrics()
    state = ReadyState(load_run_config("default"), limits, phase=READY, metrics=metrics)
    state.model = StubModel()
    state.bridge = EngineBridge(engine, metrics, limits.max_waiting, limits.request_timeout)
    state.bridge.start()
    config = uvicorn.Config(make_app(state), host="127.0.0.1", port=0, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", engine, backend, state
    finally:
        server.should_exit = True
        thread.join(30)


async def _stream(client: httpx2.AsyncClient, request_id: int, leave: bool) -> dict:
    # One streamed completion; `leave`: close the connection after the first token.
    body = {
        "prompt": str(request_id),
        "max_tokens": LONG if leave else MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        status = response.status_code
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                events.append("[DONE]")
            elif line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if leave and events[-1]["choices"] and events[-1]["choices"][0]["text"]:
                    break  # leaving the block closes the connection mid-body
    return {"status": status, "events": events}


def test_200_streams_with_50_disconnects_leak_no_page(served):
    url, engine, backend, state = served
    start = engine.stats()
    leaving = set(range(0, REQUESTS, REQUESTS // DISCONNECTS))  # every 4th

    async def run() -> list[dict]:
        limits = httpx2.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx2.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
            return await asyncio.gather(
                *(_stream(client, r, r in leaving) for r in range(REQUESTS))
            )

    results = asyncio.run(run())
    for r, result in enumerate(results):
        assert result["status"] == 200, (r, result)
        events = result["events"]
        assert all("error" not in e for e in events if e != "[DONE]"), (r, events)
        if r in leaving:
            continue
        chunks = [e for e in events[:-1] if e["choices"]]
        assert events[-1] == "[DONE]"
        assert "".join(c["choices"][0]["text"] for c in chunks) == _expected_text(r, MAX_TOKENS)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert events[-2]["usage"]["completion_tokens"] == MAX_TOKENS
    deadline = time.monotonic() + 10  # the last cancellations' round
    while state.bridge.in_flight or engine.stats().kv_pages_used:
        assert time.monotonic() < deadline, engine.stats()
        time.sleep(0.01)
    end = engine.stats()
    assert end.kv_pages_used == 0 and end.kv_pages_free == start.kv_pages_free
    assert not backend.rows and not any(backend.readers.values())  # no row holds a page
    text = httpx2.get(f"{url}/metrics").text
    assert f'etjax_requests_total{{outcome="cancelled"}} {DISCONNECTS}' in text
    assert f'etjax_requests_total{{outcome="ok"}} {REQUESTS - DISCONNECTS}' in text
    assert 'etjax_requests_total{outcome="error"} 0' in text


class _WarmUpTokenizer:
    # "Hello" is one token under a page (4 here); "Warm-up request i:" three, the last i's.
    @staticmethod
    def encode(text: str) -> list[int]:
        if text.startswith("Warm-up request"):
            return [5, 6, 7 + int(text.split()[-1].rstrip(":"))]
        return [3]


def test_the_warm_up_runs_a_step_of_every_token_bucket_and_a_burst_of_every_row_bucket():
    # What a server compiles before it says ready (etjax/serve/warm_up.py): one ragged step of
    # each padded token count up to the budget (8, 16, 32, 64 for a budget of 64) and one
    # burst of each padded row count up to the batch (1, 2, 4, 8), as the engine's own host
    # logic lays out the warm-up's requests; by hand, 4 and 4 programs.
    import dataclasses

    from etjax.buckets import batch_bucket, ragged_token_bucket
    from etjax.serve.warm_up import warm_up

    engine, backend = mock_engine(batch=8, pages=512, prefill_chunk=64)
    engine.options = dataclasses.replace(engine.options, token_budget=64, max_prefill_rows=8)
    steps, bursts = [], []
    mixed, decode = backend.mixed, backend.decode

    def counted_mixed(rows, pages, lengths, budgets, jobs, drafts=None):
        steps.append(len(rows) + sum(len(j.tokens) for j in jobs))
        return mixed(rows, pages, lengths, budgets, jobs, drafts)

    def counted_decode(rows, pages, lengths, budgets, tokens_left=None):
        bursts.append(len(rows))
        return decode(rows, pages, lengths, budgets, tokens_left)

    backend.mixed, backend.decode = counted_mixed, counted_decode
    warm_up(engine, _WarmUpTokenizer(), "buckets")
    assert {ragged_token_bucket(n) for n in steps} == {8, 16, 32, 64}
    assert {batch_bucket(n) for n in bursts} == {1, 2, 4, 8}
    assert backend.prefill_tokens == 8 + 16 + 32 + 64 + (1 + 2 + 4 + 8)  # none from the cache


def test_an_idle_engine_takes_requests_sent_together_into_its_first_round(monkeypatch):
    # With the gap widened to 0.4 s and the limit to 1 s: requests reaching the bridge at
    # 0, 0.3, 0.6 and 0.9 s (each within the gap of the last) share the first round; the one
    # at 1.2 s, past the limit, waits for the next round.
    from etjax.serve import bridge as bridge_module

    monkeypatch.setattr(bridge_module, "ARRIVAL_GAP", 0.4)
    monkeypatch.setattr(bridge_module, "GATHER_LIMIT", 1.0)
    engine, _ = mock_engine(batch=8, resident=8)
    engine.tokenizer = StubTokenizer()
    rows_per_round: list[int] = []
    step = engine.step

    def counted_step():
        rows_per_round.append(len(engine.live))
        return step()

    engine.step = counted_step
    bridge = EngineBridge(engine, Metrics(), max_waiting=8, request_timeout=60)
    bridge.start()

    async def run() -> None:
        start, tickets = time.monotonic(), []
        for r, at in enumerate((0.0, 0.3, 0.6, 0.9, 1.2)):
            await asyncio.sleep(max(at - (time.monotonic() - start), 0.0))
            tickets.append(bridge.open(serve_request(r)))
        for ticket in tickets:  # each to its last delta
            finished = False
            while not finished:
                event = await ticket.events.get()
                finished = bool(event) and event[-1].finish_reason is not None

    try:
        asyncio.run(asyncio.wait_for(run(), 30))
    finally:
        bridge.stop()
    assert rows_per_round[0] == 4
