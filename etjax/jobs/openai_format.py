"""The OpenAI Batch API file format, as `etjax batch` reads and writes it.

Input lines (what vLLM's `run-batch` and many pipelines produce):

    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "...", "messages": [...], "max_tokens": 64, "temperature": 0.7}}

`url` is "/v1/chat/completions" (`body.messages`) or "/v1/completions" (`body.prompt`, a
string). What each body field means here is one table (etjax/jobs/openai_body.py): the
OpenAI names of request fields (`max_tokens` or `max_completion_tokens`, `stop`, `n`) and
sampler settings (`temperature`, `top_p`, `seed`, `presence_penalty`, `frequency_penalty`, and
vLLM's `top_k`, `min_p`, `repetition_penalty`), accounting fields that change no output
(`user`, `metadata`, ...), fields refused with the reason, and `logprobs` (true or false) with
`top_logprobs` (0 to 20, with logprobs only) on chat completions, answered as OpenAI answers
them: per choice,
`logprobs.content` holds each generated token's `{token, logprob, bytes, top_logprobs}`, the
alternatives as `{token, logprob, bytes}` (log-probabilities at temperature 1, before
penalties: etjax.Result). `model` names the model the
caller meant and is echoed back (etjax runs the one it loaded). Anything else is an error that
names the field. `to_record` turns such a line into etjax's own record fields, so validation is
shared; the result is written back as an OpenAI output line (`output_line`, `error_line`): the
request's `custom_id`, and a `response` with `status_code` 200 and a body with `choices` and
`usage`, or an `error`. A `fingerprint` rides along for reruns; consumers ignore it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from etjax.errors import FieldError, RequestError
from etjax.jobs.openai_body import MAPPED, check_names, known_fields, special_fields
from etjax.request_fields import FIELDS, MAX_LOGPROBS
from etjax.runtime.options import SequenceOutput

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def body_fields() -> list[str]:
    """The body names a line may set, besides messages or prompt and the echoed model."""
    return [name for name in known_fields() if name not in ("model", "messages", "prompt")]


def is_openai(raw: object) -> bool:
    return isinstance(raw, dict) and "custom_id" in raw


def to_record(raw: dict) -> dict:
    """etjax record fields for an OpenAI batch line (RequestError naming the field)."""
    unknown = sorted(set(raw) - {"custom_id", "method", "url", "body"})
    if unknown:
        raise RequestError(f"unknown field {unknown[0]!r} in an OpenAI batch line")
    if raw.get("method", "POST") != "POST":
        raise RequestError(f"method={raw.get('method')!r}; must be 'POST'")
    url, body = raw.get("url"), raw.get("body")
    if url not in (CHAT, COMPLETIONS):
        raise RequestError(f"url={url!r}; must be {CHAT!r} or {COMPLETIONS!r}")
    if not isinstance(body, dict):
        raise RequestError(f"body is a {type(body).__name__}; must be an object")
    check_names(body)
    for row in FIELDS.values():
        both = [name for name in row.openai if name in body]
        if len(both) > 1:
            raise RequestError(f"body.{both[0]} and body.{both[1]} are both given")
    needed = "messages" if url == CHAT else "prompt"
    if needed not in body:
        raise RequestError(f"body.{needed} is required for {url}")
    wrong = "prompt" if url == CHAT else "messages"
    if wrong in body:
        raise RequestError(f"body.{wrong} does not belong to {url}; use body.{needed}")
    record = {MAPPED[k]: v for k, v in body.items() if MAPPED.get(k) is not None}
    record |= special_fields(body)
    if wants_logprobs(body, url):
        record["logprobs"] = body.get("top_logprobs", 0)
    return record


def wants_logprobs(body: dict, url: str = CHAT) -> bool:
    """Whether an OpenAI body asks for log-probabilities (`logprobs: true`), checked with its
    `top_logprobs` (RequestError naming the body field). Chat completions only: the legacy
    completions shape (an integer `logprobs`) is not answered."""
    if url != CHAT and ("logprobs" in body or "top_logprobs" in body):
        raise RequestError(f"body.logprobs is not supported for {url}, only for {CHAT}")
    asked = body.get("logprobs", False)
    if not isinstance(asked, bool):
        raise RequestError(f"body.logprobs={asked!r}; must be true or false")
    if "top_logprobs" in body:
        top = body["top_logprobs"]
        try:
            FIELDS["logprobs"].read(top, "record")
        except FieldError:
            raise RequestError(
                f"body.top_logprobs={top!r}; must be an integer from 0 to {MAX_LOGPROBS}"
            ) from None
        if not asked:
            raise RequestError("body.top_logprobs needs body.logprobs: true")
    return asked


def output_line(
    custom_id: str,
    raw_url: str,
    model_name: str,
    outputs: list[SequenceOutput],
    prompt_tokens: int,
    fingerprint: str,
    token_text: Callable[[int], str] | None = None,
) -> dict:
    """The OpenAI output line of a finished request (one choice per sample). With
    `token_text` (a token id's text), the request asked for log-probabilities: each choice
    carries them in OpenAI's chat-completion shape."""
    if raw_url == CHAT:
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": out.text},
                "logprobs": None if token_text is None else _logprobs(out, token_text),
                "finish_reason": _finish(out),
            }
            for i, out in enumerate(outputs)
        ]
        obj, prefix = "chat.completion", "chatcmpl-"
    else:
        choices = [
            {"index": i, "text": out.text, "finish_reason": _finish(out)}
            for i, out in enumerate(outputs)
        ]
        obj, prefix = "text_completion", "cmpl-"
    completion = sum(len(out.token_ids) for out in outputs)
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {
            "status_code": 200,
            "request_id": uuid.uuid4().hex,
            "body": {
                "id": prefix + uuid.uuid4().hex,
                "object": obj,
                "created": int(time.time()),
                "model": model_name,
                "choices": choices,
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion,
                    "total_tokens": prompt_tokens + completion,
                    # The first sample's: later samples find the prompt it prefilled.
                    "prompt_tokens_details": {
                        "cached_tokens": int(outputs[0].metrics.get("cached_tokens", 0))
                    },
                },
            },
        },
        "error": None,
        "fingerprint": fingerprint,
    }


def error_line(
    custom_id: str | int, message: str, fingerprint: str, code: str = "invalid_request"
) -> dict:
    """The OpenAI output line of a request that has no answer: a refused one
    ("invalid_request"), or one the grammar engine failed on while generating
    ("generation_failed", whose output did not satisfy its constraint)."""
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
        "fingerprint": fingerprint,
    }


def _logprobs(out: SequenceOutput, token_text: Callable[[int], str]) -> dict:
    # {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}: a
    # token's bytes are its text's UTF-8 (a token ending inside a character reads U+FFFD).
    def entry(token: int, logprob: float) -> dict:
        text = token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    tops = out.top_logprobs or [[] for _ in out.token_ids]
    content = [
        entry(token, logprob) | {"top_logprobs": [entry(t, v) for t, v in top]}
        for token, logprob, top in zip(out.token_ids, out.logprob, tops, strict=True)
    ]
    return {"content": content}


def _finish(out: SequenceOutput) -> str:
    # OpenAI's names: an end-of-sequence token or a stop string is "stop".
    return "length" if out.finish_reason == "length" else "stop"
