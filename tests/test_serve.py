"""`etjax serve` against the official `openai` client, on the embedded SmolLM2, over loopback.

One server process serves the whole module (a module-scoped fixture starts `python -m
etjax.cli serve --port 0`); its answers are held to `etjax.decode()`'s for the same prompts,
computed in this process without a server (greedy, so they must be equal token for token), to
a JSON schema validator and to OpenAI's shapes. The last test sends SIGTERM under load. The
engine bridge's back-pressure and cancellation are tested apart, on the hand-computable mock
engine (tests/engine_mock.py), without a server.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx2
import jsonschema
import openai
import pytest

import etjax
from etjax.serve.bridge import EngineBridge, Failure
from etjax.serve.errors import ApiError
from etjax.serve.metrics import Metrics
from tests.engine_mock import mock_engine, serve_request
from tests.subprocess_env import subprocess_env

# etjax against itself (the server against decode()) over short prompts and a few tokens: both
# compile cheaply (tests/compile_level.py), in about half the time, and run alike.
pytestmark = [pytest.mark.real_model, pytest.mark.compile_bound]

KEY = "test-key-1"
MAX_TOKENS = 8
MAX_BODY = 1 << 16
PROMPTS = [
    "The capital of France is",
    "Water boils at",
    "One, two, three,",
    "The opposite of hot is",
]
QUESTION = "What is the color of the sky?"
UNSATISFIABLE = {"type": "integer", "minimum": 5, "maximum": 2}
START_SECONDS = 240  # loading and warming up, compilation included


@dataclass
class Server:
    url: str
    process: subprocess.Popen
    log: list[str]
    reference: dict  # decode()'s outputs (`_reference`)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0, timeout=120)

    def metrics(self) -> dict[str, float]:
        text = httpx2.get(f"{self.url}/metrics", headers=_auth()).text
        return _parse_metrics(text)


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2):
    # A pool of 256 pages, as decode() sizes it for small workloads: the same step programs.
    config = tmp_path_factory.mktemp("serve") / "serve.toml"
    config.write_text(  # float32 matrices, as the `smollm2` reference's
        f'[model]\nweights = "float32"\n[engine]\nnum_pages = 256\n'
        f"[request]\nmax_new_tokens = {MAX_TOKENS}\n"
    )
    command = [sys.executable, "-m", "etjax.cli", "serve", "--port", "0", "--config", str(config)]
    command += ["--api-key", KEY, "--max-body-bytes", str(MAX_BODY), "--grace-period", "60"]
    # One warm-up request, not a program for every bucket: the tests' requests compile the
    # few they run, and the suite's time stays with them (tests/test_serve_mock.py checks
    # what the default warm-up lays out).
    command += ["--warm-up", "one"]
    process = subprocess.Popen(
        command, env=subprocess_env(), stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True
    )
    log: list[str] = []
    listening = threading.Event()

    def read_stderr() -> None:  # keeps the pipe drained for the server's whole life
        for line in process.stderr:
            log.append(line)
            if "listening on" in line:
                listening.set()

    threading.Thread(target=read_stderr, daemon=True).start()
    try:
        reference = _reference(smollm2)  # while the server loads and warms up
        assert listening.wait(60), "".join(log)
        url = re.search(r"listening on (http://\S+)", "".join(log)).group(1)
        deadline = time.monotonic() + START_SECONDS
        while httpx2.get(f"{url}/health").status_code != 200:
            assert process.poll() is None, "".join(log)
            assert time.monotonic() < deadline, "".join(log)
            time.sleep(0.5)
        yield Server(url, process, log, reference)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def reference(server):
    return server.reference


def _reference(smollm2) -> dict:
    """decode()'s greedy outputs for the completions prompts and the chat question, in one
    call: one batch's step programs to compile, not two."""
    *plain, chat = etjax.decode(
        [*PROMPTS, [{"role": "user", "content": QUESTION}]],
        model=smollm2,
        max_new_tokens=MAX_TOKENS,
        logprobs=3,
        prompt_logprobs=True,
    )
    return {"plain": plain, "chat": chat}


def test_health_needs_no_key_and_the_rest_do(server):
    assert httpx2.get(f"{server.url}/health").json() == {"status": "ready"}
    refused = httpx2.get(f"{server.url}/v1/models")
    assert refused.status_code == 401
    assert refused.json()["error"]["code"] == "invalid_api_key"
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["smollm2-135m-instruct"]


def test_completions_and_chat_equal_decode(server, reference):
    client = server.client()
    for prompt, expected in zip(PROMPTS[:2], reference["plain"], strict=False):
        answer = client.completions.create(
            model="smollm2-135m-instruct", prompt=prompt, max_tokens=MAX_TOKENS
        )
        assert answer.choices[0].text == expected.text
        assert answer.choices[0].finish_reason == {"eos": "stop"}.get(
            expected.finish_reason, expected.finish_reason
        )
        assert answer.usage.prompt_tokens == len(expected.prompt_token_ids)
        assert answer.usage.completion_tokens == len(expected.token_ids)
    chat = client.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=[{"role": "user", "content": QUESTION}],
        max_completion_tokens=MAX_TOKENS,
    )
    assert chat.choices[0].message.content == reference["chat"].text
    assert chat.usage.prompt_tokens == len(reference["chat"].prompt_token_ids)


def test_streams_equal_decode_and_end_with_usage(server, reference):
    client = server.client()
    stream = client.completions.create(
        model="smollm2-135m-instruct",
        prompt=PROMPTS[2],
        max_tokens=MAX_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reference["plain"][2].text
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == len(reference["plain"][2].token_ids)
    for _ in range(2):
        stream = client.chat.completions.create(
            model="smollm2-135m-instruct",
            messages=[{"role": "user", "content": QUESTION}],
            max_tokens=MAX_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == reference["chat"].text
        assert chunks[0].choices[0].delta.role == "assistant"
    # Asked again, the prompt's full pages but the last token's come from the prefix cache.
    cached = chunks[-1].usage.prompt_tokens_details.cached_tokens
    assert cached == (len(reference["chat"].prompt_token_ids) - 1) // 16 * 16


def test_logprobs_in_openai_shape_equal_decode(server, reference):
    answer = server.client().chat.completions.create(
        model="smollm2-135m-instruct",
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=MAX_TOKENS,
        logprobs=True,
        top_logprobs=3,
    )
    expected = reference["chat"]
    content = answer.choices[0].logprobs.content
    tokenizer_text = [t.token for t in content]
    assert "".join(tokenizer_text) == expected.text  # ASCII output: tokens spell the text
    assert len(content) == len(expected.token_ids)
    for entry, value, top in zip(content, expected.logprob, expected.top_logprobs, strict=True):
        assert entry.logprob == pytest.approx(value, abs=1e-4)
        assert bytes(entry.bytes) == entry.token.encode("utf-8")
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            [v for _, v in top], abs=1e-4
        )
        assert entry.top_logprobs[0].token == entry.token  # greedy: the drawn token is first
    # /v1/completions' own shape: parallel lists and each token's offset in the text.
    answer = server.client().completions.create(
        model="smollm2-135m-instruct", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, logprobs=3
    )
    expected, got = reference["plain"][0], answer.choices[0].logprobs
    assert got.token_logprobs == pytest.approx(expected.logprob, abs=1e-4)
    assert "".join(got.tokens) == expected.text
    assert got.text_offset == [len("".join(got.tokens[:i])) for i in range(len(got.tokens))]
    for top, pairs in zip(got.top_logprobs, expected.top_logprobs, strict=True):
        assert sorted(top.values()) == pytest.approx(sorted(v for _, v in pairs), abs=1e-4)


def test_the_entropy_trace_and_prompt_logprobs_on_request(server, reference):
    answer = server.client().completions.create(
        model="smollm2-135m-instruct",
        prompt=PROMPTS[0],
        max_tokens=MAX_TOKENS,
        extra_body={"etjax": {"trace": True, "prompt_logprobs": True}},
    )
    extra, expected = answer.choices[0].model_extra["etjax"], reference["plain"][0]
    assert extra["trace"]["entropy"] == pytest.approx(expected.entropy, abs=1e-4)
    assert extra["trace"]["kept_blocks"] == expected.kept_blocks
    assert extra["prompt_logprobs"][0] is None
    assert extra["prompt_logprobs"][1:] == pytest.approx(expected.prompt_logprobs[1:], abs=1e-4)


def test_two_samples_and_a_json_schema_that_validates(server, reference):
    client = server.client()
    # Greedy, both samples are decode()'s text (a seeded draw could differ from one asked
    # before where the prefix cache's rounding moves it across a token boundary). The
    # shortest prompt: its two rows' prefill fits the 8-token step the others ran.
    answer = client.completions.create(
        model="smollm2-135m-instruct", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, n=2
    )
    expected = reference["plain"][1]
    assert [c.index for c in answer.choices] == [0, 1]
    assert [c.text for c in answer.choices] == [expected.text] * 2
    assert answer.usage.completion_tokens == 2 * len(expected.token_ids)
    assert answer.usage.prompt_tokens == len(expected.prompt_token_ids)
    schema = {
        "type": "object",
        "properties": {"age": {"type": "integer"}},
        "required": ["age"],
        "additionalProperties": False,
    }
    answer = client.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=[{"role": "user", "content": "How old is Ann? Answer in JSON."}],
        max_tokens=24,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    )
    assert answer.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(answer.choices[0].message.content), schema)


def test_concurrent_streams_equal_decode(server, reference):
    client = server.client()

    def stream(i: int) -> str:
        chunks = client.completions.create(
            model="smollm2-135m-instruct",
            prompt=PROMPTS[i % len(PROMPTS)],
            max_tokens=MAX_TOKENS,
            stream=True,
        )
        return "".join(c.choices[0].text for c in chunks if c.choices)

    with ThreadPoolExecutor(12) as pool:
        texts = list(pool.map(stream, range(12)))
    assert texts == [reference["plain"][i % len(PROMPTS)].text for i in range(12)]


def test_a_client_that_disconnects_frees_its_pages(server):
    before = server.metrics()
    body = {"prompt": PROMPTS[0], "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with (
        httpx2.Client(timeout=60) as http,
        http.stream("POST", f"{server.url}/v1/completions", json=body, headers=_auth()) as response,
    ):
        assert response.status_code == 200
        next(response.iter_lines())  # generating: its pages are held
        held = server.metrics()
        assert held["etjax_kv_pages_used"] > 0
    deadline = time.monotonic() + 20
    while (now := server.metrics())["etjax_kv_pages_used"] > 0:
        assert time.monotonic() < deadline, now
        time.sleep(0.1)
    cancelled = 'etjax_requests_total{outcome="cancelled"}'
    assert now[cancelled] == before[cancelled] + 1
    assert now["etjax_requests_running"] == 0


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b'{"prompt": "x", ', 400, None),  # malformed JSON
        (b'{"prompt": "x", "colour": 1}', 400, "colour"),  # unknown field
        (b'{"prompt": "x", "max_tokens": "ten"}', 400, "max_tokens"),  # wrong type
        (b'{"prompt": "x", "max_tokens": 1000000}', 400, "max_tokens"),  # over the cap
        (b'{"prompt": "\\ud800"}', 400, "prompt"),  # a lone surrogate
        (b'{"prompt": "x", "model": "gpt-9"}', 404, "model"),
        (b'{"prompt": "x", "model": ["a"]}', 404, "model"),
        (b'{"prompt": "x", "stream": "yes"}', 400, "stream"),
        (b'{"prompt": "x", "etjax": {"trusted_chat": true}}', 400, "etjax.trusted_chat"),
        (
            json.dumps(
                {
                    "prompt": "x",
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"name": "a", "schema": UNSATISFIABLE},
                    },
                }
            ).encode(),
            400,
            "response_format.json_schema.schema",
        ),  # an unsatisfiable schema
        (b'{"prompt": "' + b"x" * MAX_BODY + b'"}', 413, None),
    ],
)
def test_bad_inputs_get_their_status_naming_the_field(server, body, status, param):
    response = httpx2.post(f"{server.url}/v1/completions", content=body, headers=_auth())
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param
    if param is not None:
        assert f"body.{param}" in error["message"]


def test_the_server_serves_on_after_bad_inputs(server, reference):
    # Tokenize, detokenize and a completion still answer as before.
    tokens = httpx2.post(f"{server.url}/tokenize", json={"prompt": PROMPTS[0]}, headers=_auth())
    assert tokens.json()["tokens"] == reference["plain"][0].prompt_token_ids
    text = httpx2.post(
        f"{server.url}/detokenize",
        json={"tokens": reference["plain"][0].token_ids},
        headers=_auth(),
    )
    assert text.json()["prompt"] == reference["plain"][0].text
    answer = server.client().completions.create(
        model="smollm2-135m-instruct", prompt=PROMPTS[0], max_tokens=MAX_TOKENS
    )
    assert answer.choices[0].text == reference["plain"][0].text


def test_metrics_are_prometheus_text(server):
    text = httpx2.get(f"{server.url}/metrics", headers=_auth()).text
    sample = re.compile(r'^[a-z0-9_]+(\{[a-z]+="[^"]*"\})? -?[0-9.e+-]+$')
    for line in text.splitlines():
        assert line.startswith("# HELP ") or line.startswith("# TYPE ") or sample.match(line), line
    values = _parse_metrics(text)
    assert values["etjax_generation_tokens_total"] > 0
    assert values["etjax_kv_pages_total"] == 255
    ttft = values['etjax_time_to_first_token_seconds_bucket{le="+Inf"}']
    assert ttft == values["etjax_time_to_first_token_seconds_count"] > 0
    assert values['etjax_kept_fraction_bucket{le="1.0"}'] == values["etjax_kept_fraction_count"]


def test_sigterm_lets_streams_in_flight_finish_and_exits_0(server):
    # The module's last test: it ends the server.
    body = {"prompt": PROMPTS[1], "max_tokens": 40, "ignore_eos": True, "stream": True}
    started = threading.Barrier(4)
    results: list[list[str]] = []

    def stream() -> None:
        with (
            httpx2.Client(timeout=120) as http,
            http.stream(
                "POST", f"{server.url}/v1/completions", json=body, headers=_auth()
            ) as response,
        ):
            lines = response.iter_lines()
            first = next(lines)
            started.wait()
            results.append([line for line in (first, *lines) if line])

    threads = [threading.Thread(target=stream) for _ in range(3)]
    for thread in threads:
        thread.start()
    started.wait(timeout=120)
    server.process.send_signal(signal.SIGTERM)
    for thread in threads:
        thread.join(timeout=120)
    assert server.process.wait(timeout=90) == 0, "".join(server.log)
    assert len(results) == 3
    for lines in results:
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert lines[-1] == "data: [DONE]"
        assert events[-1]["choices"][0]["finish_reason"] == "length"
    with pytest.raises(httpx2.ConnectError):
        httpx2.get(f"{server.url}/health")


# The engine bridge on the mock engine: back-pressure, cancellation, timeouts. -------------


def test_a_full_queue_is_refused_with_retry_after():
    engine, _ = mock_engine(batch=2, resident=2)
    bridge = EngineBridge(engine, Metrics(), max_waiting=1, request_timeout=60)

    async def open_four() -> ApiError:
        for r in range(3):  # 2 resident rows + 1 waiting
            bridge.open(serve_request(r, 4))
        with pytest.raises(ApiError) as refused:
            bridge.open(serve_request(3, 4))
        return refused.value

    refused = asyncio.run(open_four())
    assert refused.status == 429 and refused.headers == {"Retry-After": "1"}


def test_bridge_cancellation_frees_pages_and_a_late_request_times_out():
    engine, _ = mock_engine(batch=2, resident=2)
    metrics = Metrics()
    bridge = EngineBridge(engine, metrics, max_waiting=4, request_timeout=60)
    bridge.start()

    async def run() -> None:
        long = bridge.open(serve_request(1, 200))
        assert await long.events.get() == []  # accepted
        first = await long.events.get()
        assert first[0].token_ids  # generating
        bridge.cancel(long)
        for _ in range(100):
            await asyncio.sleep(0.02)
            if engine.stats().kv_pages_used == 0 and bridge.in_flight == 0:
                break
        assert engine.stats().kv_pages_used == 0 and bridge.in_flight == 0
        bridge.request_timeout = 0.0
        late = bridge.open(serve_request(2, 200))
        events = [await late.events.get() for _ in range(2)]
        assert isinstance(events[-1], Failure) and events[-1].error.status == 504

    try:
        asyncio.run(run())
    finally:
        bridge.stop()


def _parse_metrics(text: str) -> dict[str, float]:
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def test_a_bad_flag_fails_before_the_socket_and_the_model(capsys):
    from etjax.cli import main

    assert main(["serve", "--max-tokens", "0", "--port", "0"]) == 2
    assert "--max-tokens=0; must be a positive integer" in capsys.readouterr().err


def test_a_failing_engine_thread_fails_its_requests_and_refuses_new_ones():
    engine, _ = mock_engine(batch=2, resident=2)
    bridge = EngineBridge(engine, Metrics(), max_waiting=4, request_timeout=60)

    def bug(ticket, now) -> None:
        raise RuntimeError("a bug in the loop")

    bridge._deliver = bug  # the first round's end raises
    bridge.start()

    async def run() -> None:
        ticket = bridge.open(serve_request(1, 40))
        event = None
        while not isinstance(event, Failure):
            event = await asyncio.wait_for(ticket.events.get(), 10)
        assert event.error.status == 500
        with pytest.raises(ApiError) as refused:
            bridge.open(serve_request(2, 4))
        assert refused.value.status == 503

    asyncio.run(run())
    bridge.stop()
    assert bridge.broken


def test_a_sample_the_engine_ended_with_an_error_is_no_success():
    from etjax.runtime.options import SequenceOutput
    from etjax.serve.responses import Shape

    shape = Shape(serve_request(1, 4), "m", str)
    fine = SequenceOutput(token_ids=[5], logprob=[-0.1], text="a", finish_reason="eos")
    failed = SequenceOutput(finish_reason="error", error="the grammar engine failed")
    assert shape.whole([fine])["choices"][0]["finish_reason"] == "stop"
    with pytest.raises(ApiError) as refused:
        shape.whole([fine, failed])
    assert refused.value.status == 500
    assert "sample 1 failed in the engine: the grammar engine failed" in refused.value.message
