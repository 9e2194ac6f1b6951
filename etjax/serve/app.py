"""The routes: `make_app(state)` is the ASGI application `etjax serve` runs.

    POST /v1/completions, /v1/chat/completions   generate (streamed as server-sent events
                                                 with "stream": true)
    GET  /v1/models                              the model served
    GET  /health                                 200 ready, 503 loading, draining or failed
    GET  /metrics                                Prometheus text (etjax/serve/metrics.py)
    POST /tokenize, /detokenize                  the model's tokenizer

With an API key every route but /health needs `Authorization: Bearer KEY`. A body is read up
to the size limit and no further (413). Nothing a client sends is evaluated or used as a path:
`model` is compared with the served names, never loaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import threading
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from etjax.jobs.openai_format import CHAT, COMPLETIONS
from etjax.request_checks import tokenize_prompt
from etjax.serve.body import json_object, read_body
from etjax.serve.bridge import EngineBridge, Failure, Ticket
from etjax.serve.errors import ApiError, json_bytes, json_response
from etjax.serve.metrics import engine_values
from etjax.serve.responses import Shape
from etjax.serve.state import READY, ServerState

# A body up to this size is parsed and tokenized on the event loop (well under a millisecond);
# a larger one on a worker thread, so a long prompt's tokenization never holds up the other
# streams. The handoff to a thread and back costs two thread wakeups, which on a busy
# machine are most of a short request's time before it reaches the engine. A body that may
# hold a schema or grammar (checked by compiling it) always goes to a thread.
INLINE_BODY_BYTES = 4096
GRAMMAR_WORDS = (b"response_format", b"guided_", b"json_schema", b"regex", b"grammar", b"choices")


def make_app(state: ServerState, on_failure=lambda: None) -> Starlette:
    """The application over `state`; its startup loads the model on a thread (the server
    answers /health meanwhile), its shutdown stops the engine thread."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        loader = threading.Thread(
            target=state.load, args=(on_failure,), name="etjax-load", daemon=True
        )
        loader.start()
        yield
        if state.bridge is not None:
            await run_in_threadpool(state.bridge.stop)

    app = Starlette(
        routes=[
            Route("/v1/completions", _completions, methods=["POST"]),
            Route("/v1/chat/completions", _chat_completions, methods=["POST"]),
            Route("/v1/models", _models, methods=["GET"]),
            Route("/health", _health, methods=["GET"]),
            Route("/metrics", _metrics, methods=["GET"]),
            Route("/tokenize", _tokenize, methods=["POST"]),
            Route("/detokenize", _detokenize, methods=["POST"]),
        ],
        exception_handlers={HTTPException: _http_error, ApiError: _api_error},
        lifespan=lifespan,
    )
    app.state.serve = state
    return ApiKeyCheck(app, state.api_key)


class ApiKeyCheck:
    """ASGI middleware: 401 unless `Authorization: Bearer KEY` (every route but /health)."""

    def __init__(self, app, key: str | None) -> None:
        self.app, self.key = app, None if key is None else key.encode("utf-8")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self.key is not None and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                error = ApiError(
                    401,
                    "a valid API key is needed: Authorization: Bearer KEY",
                    code="invalid_api_key",
                )
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _api_error(request: Request, error: ApiError) -> Response:
    return error.response()


async def _http_error(request: Request, error: HTTPException) -> Response:
    # Starlette's own refusals (no such route, wrong method) in OpenAI's shape.
    message = f"{request.method} {request.url.path}: {error.detail}"
    return ApiError(error.status_code, message).response()


def _state(request: Request) -> ServerState:
    return request.app.state.serve


async def _body(request: Request) -> bytes:
    # The body, read no further than the limit (413): a declared length over it is refused
    # before a byte is read.
    limit = _state(request).limits.max_body_bytes
    too_large = ApiError(413, f"the body is over this server's limit of {limit} bytes")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def _completions(request: Request) -> Response:
    return await _generate(request, COMPLETIONS)


async def _chat_completions(request: Request) -> Response:
    return await _generate(request, CHAT)


async def _generate(request: Request, url: str) -> Response:
    state = _state(request)
    state.require_ready()
    raw = await _body(request)
    model = state.model
    arguments = (raw, url, model, state.config, state.limits, state.served)
    if len(raw) <= INLINE_BODY_BYTES and not any(word in raw for word in GRAMMAR_WORDS):
        parsed = read_body(*arguments)
    else:
        parsed = await run_in_threadpool(read_body, *arguments)
    state.check_fits(parsed)
    bridge = state.bridge
    ticket = bridge.open(parsed)
    shape = Shape(parsed, state.model_name, lambda t: model.tokenizer.decode([t]))
    try:
        first = await ticket.events.get()  # accepted, or refused by the engine
    except asyncio.CancelledError:
        bridge.cancel(ticket)
        raise
    if isinstance(first, Failure):
        raise first.error
    if parsed.stream:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(
            _stream(ticket, shape, bridge), media_type="text/event-stream", headers=headers
        )
    return await _whole(request, ticket, shape, bridge)


async def _whole(request: Request, ticket: Ticket, shape: Shape, bridge: EngineBridge) -> Response:
    # Wait for every sample, or for the client to go away (then its request is cancelled).
    outputs = [None] * ticket.samples
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        while any(out is None for out in outputs):
            event = asyncio.ensure_future(ticket.events.get())
            await asyncio.wait({event, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not event.done():
                event.cancel()
                bridge.cancel(ticket)
                return Response(status_code=499)  # nobody reads it
            event = event.result()
            if isinstance(event, Failure):
                raise event.error
            for delta in event:
                if delta.output is not None:
                    outputs[delta.index] = delta.output
    except asyncio.CancelledError:
        bridge.cancel(ticket)
        raise
    finally:
        gone.cancel()
    return json_response(shape.whole(outputs))


async def _disconnected(request: Request) -> None:
    # The body is read, so the next ASGI message is the client's disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(obj: object) -> bytes:
    return b"data: " + json_bytes(obj) + b"\n\n"


async def _stream(ticket: Ticket, shape: Shape, bridge: EngineBridge) -> AsyncIterator[bytes]:
    # Server-sent events: a chunk per round that produced output, then usage if asked and
    # [DONE]. A failure is an error event that ends the stream. If the client goes away,
    # Starlette cancels this generator and the request is cancelled with it.
    outputs = [None] * ticket.samples
    settled = False
    try:
        if shape.chat:
            yield _sse(shape.role_chunk())
        while any(out is None for out in outputs):
            event = await ticket.events.get()
            if isinstance(event, Failure):
                settled = True
                yield _sse(event.error.body())
                return
            if not event:
                continue
            try:
                chunk = shape.chunk(event)
            except ApiError as error:
                yield _sse(error.body())
                return
            for delta in event:
                if delta.output is not None:
                    outputs[delta.index] = delta.output
            yield _sse(chunk)
        settled = True
        if shape.request.include_usage:
            yield _sse(shape.usage_chunk(outputs))
        yield b"data: [DONE]\n\n"
    finally:
        if not settled:
            bridge.cancel(ticket)


async def _models(request: Request) -> Response:
    state = _state(request)
    state.require_ready()
    entry = {"id": state.model_name, "object": "model", "created": 0, "owned_by": "etjax"}
    return json_response({"object": "list", "data": [entry]})


async def _health(request: Request) -> Response:
    state = _state(request)
    phase = "failed" if state.bridge is not None and state.bridge.broken else state.phase
    return json_response({"status": phase}, 200 if phase == READY else 503)


async def _metrics(request: Request) -> Response:
    # The engine's gauges and counters from its last snapshot: no wait for a round.
    state = _state(request)
    if state.bridge is not None:
        state.metrics.set(**engine_values(state.bridge.engine.stats()))
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


async def _tokenize(request: Request) -> Response:
    # {"prompt": str} or {"messages": [...]} (rendered by the chat template, the assistant's
    # turn opened) -> {"tokens", "count", "max_model_len"}.
    state = _state(request)
    state.require_ready()
    body = _tool_body(await _body(request), state, ("prompt", "messages"))
    if ("prompt" in body) == ("messages" in body):
        raise ApiError(400, "give body.prompt (a string) or body.messages (a list)")
    field = "prompt" if "prompt" in body else "messages"
    value = body[field]
    if not isinstance(value, list if field == "messages" else str):
        raise ApiError(400, f"body.{field} is a {type(value).__name__}", field)
    model = state.model
    ids, error = await run_in_threadpool(tokenize_prompt, model, value, 0, False, None, 0)
    if error is not None and not ids:
        raise ApiError(400, f"body.{field}: {error}", field)
    context = state.config.options.context_limit(model.config.max_position_embeddings)
    return json_response({"tokens": ids, "count": len(ids), "max_model_len": context})


async def _detokenize(request: Request) -> Response:
    # {"tokens": [ids]} -> {"prompt": text}
    state = _state(request)
    state.require_ready()
    body = _tool_body(await _body(request), state, ("tokens",))
    tokens, vocab = body.get("tokens"), state.model.tokenizer.vocab_size
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens
    ):
        raise ApiError(400, f"body.tokens must be a list of token ids in [0, {vocab})", "tokens")
    return json_response({"prompt": state.model.tokenizer.decode(tokens)})


def _tool_body(raw: bytes, state: ServerState, fields: tuple[str, ...]) -> dict:
    body = json_object(raw)
    allowed = {"model", *fields}
    for name in sorted(body):
        if name not in allowed:
            raise ApiError(400, f"body.{name} is not a known field; allowed: {sorted(allowed)}")
    model = body.get("model")
    if "model" in body and (not isinstance(model, str) or model not in state.served):
        raise ApiError(404, f"body.model={body['model']!r} is not served", "model")
    return body
