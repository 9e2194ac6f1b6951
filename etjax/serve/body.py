"""`read_body`: an OpenAI request body, read through the request-field table.

The server is one more door of etjax/request_fields.py, read as a batch job reads an OpenAI
line: the body's names go through etjax/jobs/openai_body.py's table (mapped, special, ignored
or refused, anything else unknown) into a record, whose fields are read at the record door
with the run config's [request] and [sampler] tables as defaults. So a bad value is the same
`FieldError` here as anywhere, reported with the body name the client used (`max_tokens`, not
`max_new_tokens`).

What only a server has:

- `stream` (true or false) and `stream_options` ({"include_usage": bool}, with stream);
- `priority`: a number, queue order under the priority policy (vLLM's name for the record
  field of the same meaning);
- `etjax`: an object of etjax's own settings, any request field open to records
  (`prompt_logprobs`, `max_new_tokens`, ...) or sampler setting (`sampler`, `target_entropy`,
  ...) by its etjax name, and `trace: true`, which adds each generated token's entropy trace
  to the answer. A field given both there and by its OpenAI name is refused.

A request without `seed` samples from a fresh random seed; each of its `n` samples from a
stream derived from it, as a batch record's do. `trusted_chat` is never a client's to set (it
is closed at the record door): special-token text in a message stays text.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
from dataclasses import dataclass

from etjax.errors import FieldError, RequestError
from etjax.jobs import openai_format
from etjax.jobs.openai_body import MAPPED, REFUSED, known_fields
from etjax.loaders.loaded_model import Model
from etjax.request_checks import derived_seed, sampler_settings, tokenize_prompt
from etjax.request_fields import (
    FIELDS,
    RECORD,
    RequestSettings,
    build_request,
    open_at,
    read_fields,
)
from etjax.run_config import RunConfig
from etjax.sampling.settings import SamplerSettings
from etjax.serve.errors import ApiError
from etjax.serve.limits import ServeLimits

SERVER_FIELDS = ("stream", "stream_options", "priority", "etjax")
TRACE = "trace"  # the `etjax` object's own switch
_SAMPLER_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplerSettings))
# What the `etjax` object may hold: record-door request fields and sampler settings.
EXTENSION_FIELDS = frozenset(open_at(RECORD)) | _SAMPLER_FIELDS | {TRACE}


@dataclass
class ServeRequest:
    """A checked request: its tokens, one `RequestSettings` per sample (each with its own
    seed), and how the answer is shaped."""

    url: str
    model: str | None  # the name the body gave, or None
    prompt_ids: list[int]
    samples: list[RequestSettings]
    priority: float
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    logprobs: bool  # the answer carries log-probabilities (chat's true, completions' k)
    trace: bool  # each choice carries its entropy trace (etjax.trace)


def read_body(
    raw: bytes,
    url: str,
    model: Model,
    config: RunConfig,
    limits: ServeLimits,
    served: frozenset[str],
) -> ServeRequest:
    """Parse and check a body for `url` (/v1/completions or /v1/chat/completions); raises
    `ApiError`: 400 naming the field at fault, 404 for a `model` not in `served` (the names
    the server answers to; the name is only compared, never loaded)."""
    body = json_object(raw)
    if "model" in body and (not isinstance(body["model"], str) or body["model"] not in served):
        raise ApiError(
            404,
            f"body.model={body['model']!r}: this server serves {sorted(served)}",
            "model",
            "model_not_found",
        )
    server = {k: body.pop(k) for k in SERVER_FIELDS if k in body}
    _check_names(body)
    stream = _bool(server.get("stream", False), "stream")
    include_usage = _stream_options(server.get("stream_options"), stream)
    extension = _extension(server.get("etjax"))
    trace = _bool(extension.pop(TRACE, False), f"etjax.{TRACE}")
    legacy = _legacy_logprobs(body) if url == openai_format.COMPLETIONS else None
    try:
        record = openai_format.to_record({"url": url, "body": body})
        logprobs = openai_format.wants_logprobs(body, url) or legacy is not None
    except RequestError as e:
        raise ApiError(400, str(e), _param(str(e))) from None
    sources = _sources(body)
    if legacy is not None:
        record["logprobs"], sources["logprobs"] = legacy, "logprobs"
    for name, value in extension.items():
        _add(record, sources, name, value, f"etjax.{name}")
    if "priority" in server:
        _add(record, sources, "priority", server["priority"], "priority")
    try:
        settings, asked = _settings(record, config)
    except FieldError as e:
        param = sources.get(e.field, e.field)
        raise ApiError(400, f"body.{param}={e.value!r}; must be {e.allowed}", param) from None
    except RequestError as e:
        raise ApiError(400, str(e), _param(str(e))) from None
    if settings.max_new_tokens > limits.max_tokens:
        param = sources.get("max_new_tokens", "max_tokens")
        raise ApiError(
            400,
            f"body.{param}={settings.max_new_tokens}; this server allows at most "
            f"{limits.max_tokens} tokens per sample",
            param,
        )
    field = "messages" if url == openai_format.CHAT else "prompt"
    prompt = record[field]
    if field == "prompt" and not isinstance(prompt, str):
        raise ApiError(400, f"body.prompt is a {type(prompt).__name__}; must be a string", field)
    if field == "messages" and not isinstance(prompt, list):
        raise ApiError(400, f"body.messages is a {type(prompt).__name__}; must be a list", field)
    ids, error = tokenize_prompt(
        model,
        prompt,
        0,
        asked.chat,
        asked.system_prompt,
        settings.max_new_tokens,
        asked.trusted_chat,
        config.options.context_limit(model.config.max_position_embeddings),
    )
    if error is not None:
        code = "context_length_exceeded" if "context is" in error else None
        raise ApiError(400, f"body.{field}: {error}", field, code)
    seed = settings.sampler.seed
    seeds = [seed] if asked.n == 1 else [derived_seed(seed, j) for j in range(asked.n)]
    samples = [
        dataclasses.replace(settings, sampler=dataclasses.replace(settings.sampler, seed=s))
        for s in seeds
    ]
    return ServeRequest(
        url=url,
        model=body.get("model") if isinstance(body.get("model"), str) else None,
        prompt_ids=ids,
        samples=samples,
        priority=asked.priority,
        stream=stream,
        include_usage=include_usage,
        # etjax.logprobs (k) is answered as chat's top_logprobs or completions' logprobs are.
        logprobs=logprobs or settings.logprobs > 0,
        trace=trace,
    )


def json_object(raw: bytes) -> dict:
    """The body as a JSON object (ApiError 400 saying what is wrong with it)."""
    try:
        body = json.loads(raw)
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the body is not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ApiError(
            400, f"the body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
        ) from None
    except RecursionError:
        raise ApiError(400, "the body's JSON is nested too deeply") from None
    except ValueError as e:  # an integer of more digits than Python converts
        raise ApiError(400, f"the body's JSON holds a value Python cannot read: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the body is a JSON {type(body).__name__}; must be an object")
    return body


def _check_names(body: dict) -> None:
    # openai_body's table, with the server's own fields among the allowed.
    allowed = sorted({*known_fields(), *SERVER_FIELDS})
    for name in sorted(body):
        if name in REFUSED:
            raise ApiError(400, f"body.{name} is not supported: {REFUSED[name]}", name)
        if name not in allowed:
            raise ApiError(400, f"body.{name} is not a known field; allowed: {allowed}", name)


def _legacy_logprobs(body: dict) -> int | None:
    # /v1/completions' own `logprobs`: an integer k (the k most likely tokens at each one),
    # answered in that endpoint's shape; taken out of the body, which the batch door's table
    # reads as chat's switch.
    if "top_logprobs" in body:
        raise ApiError(
            400, "body.top_logprobs is for chat; /v1/completions takes logprobs: k", "top_logprobs"
        )
    if "logprobs" not in body:
        return None
    k = body.pop("logprobs")
    if k is None:
        return None
    try:
        return FIELDS["logprobs"].read(k, RECORD)
    except FieldError as e:
        raise ApiError(400, f"body.logprobs={k!r}; must be {e.allowed}", "logprobs") from None


def _bool(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise ApiError(400, f"body.{name}={value!r}; must be true or false", name)
    return value


def _stream_options(value: object, stream: bool) -> bool:
    if value is None:
        return False
    if not stream:
        raise ApiError(400, "body.stream_options needs body.stream: true", "stream_options")
    if not isinstance(value, dict) or set(value) - {"include_usage"}:
        raise ApiError(
            400,
            f"body.stream_options={value!r}; must be an object with include_usage only",
            "stream_options",
        )
    return _bool(value.get("include_usage", False), "stream_options.include_usage")


def _extension(value: object) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ApiError(400, f"body.etjax is a {type(value).__name__}; must be an object", "etjax")
    for name in sorted(value):
        if name not in EXTENSION_FIELDS:
            raise ApiError(
                400,
                f"body.etjax.{name} is not a known field; allowed: {sorted(EXTENSION_FIELDS)}",
                f"etjax.{name}",
            )
    return dict(value)


def _sources(body: dict) -> dict[str, str]:
    # Record field -> the body name it came from, so a FieldError names what the client sent.
    sources = {MAPPED[k]: k for k in body if MAPPED.get(k) is not None}
    if "response_format" in body:
        sources["json_schema"] = "response_format"
    if "top_logprobs" in body:
        sources["logprobs"] = "top_logprobs"
    if "top_k" in body:
        sources["top_k"] = "top_k"
    return sources


def _add(record: dict, sources: dict, name: str, value: object, body_name: str) -> None:
    if name in record:
        other = sources.get(name, name)
        raise ApiError(400, f"body.{body_name} and body.{other} are both given", body_name)
    record[name], sources[name] = value, body_name


def _settings(record: dict, config: RunConfig):
    # As a batch record is read (etjax/jobs/records.py): sampler settings over the config's
    # [sampler], request fields at the record door over its [request]; a fresh seed if none.
    overrides = {k: record[k] for k in _SAMPLER_FIELDS if k in record}
    base = dataclasses.asdict(config.sampler) | overrides
    if "seed" not in record:
        base["seed"] = secrets.randbits(32)
    sampler = sampler_settings(base.pop("sampler"), base.pop("temperature"), base.pop("seed"), base)
    given = {k: v for k, v in record.items() if k in FIELDS}
    return build_request(read_fields(given, RECORD, dataclasses.asdict(config.request)), sampler)


_BODY_NAME = re.compile(r"body\.([A-Za-z_][A-Za-z0-9_.]*[A-Za-z0-9_])")


def _param(message: str) -> str | None:
    # The first body field a message names ("body.top_logprobs=..." -> "top_logprobs").
    found = _BODY_NAME.search(message)
    return found.group(1) if found else None
