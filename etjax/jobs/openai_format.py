"""The OpenAI Batch API file format, as `etjax batch` reads and writes it.

Input lines (what vLLM's `run-batch` and many pipelines produce):

    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "...", "messages": [...], "max_tokens": 64, "temperature": 0.7}}

`url` is "/v1/chat/completions" (`body.messages`) or "/v1/completions" (`body.prompt`, a
string). `body` may hold the OpenAI names of request fields (`max_tokens` or
`max_completion_tokens`, `stop`, `n`: etjax/request_fields.py) and `temperature`, `top_p`,
`seed`, `presence_penalty`, `frequency_penalty`; `model` names the model the
caller meant and is echoed back (etjax runs the one it loaded). Anything else is an error that
names the field. `to_record` turns such a line into etjax's own record fields, so validation is
shared; the result is written back as an OpenAI output line (`output_line`, `error_line`): the
request's `custom_id`, and a `response` with `status_code` 200 and a body with `choices` and
`usage`, or an `error`. A `fingerprint` rides along for reruns; consumers ignore it.
"""

from __future__ import annotations

import time
import uuid

from etjax.errors import RequestError
from etjax.request_fields import FIELDS
from etjax.runtime.options import SequenceOutput

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
# Body names of request fields (etjax/request_fields.py, their `openai` names) and of sampler
# settings, each with the etjax record field it becomes; "model" is only echoed back.
_BODY_FIELDS = {
    "model": None,
    "messages": "messages",
    "prompt": "prompt",
    **{body: name for name, row in FIELDS.items() for body in row.openai},
    **{k: k for k in ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty")},
}


def body_fields() -> list[str]:
    """The body names a line may set, besides messages or prompt and the echoed model."""
    return [
        name for name, field in _BODY_FIELDS.items() if field not in (None, "messages", "prompt")
    ]


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
    unknown = sorted(set(body) - set(_BODY_FIELDS))
    if unknown:
        raise RequestError(f"body.{unknown[0]} is not supported; allowed: {sorted(_BODY_FIELDS)}")
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
    return {_BODY_FIELDS[k]: v for k, v in body.items() if _BODY_FIELDS[k] is not None}


def output_line(
    custom_id: str,
    raw_url: str,
    model_name: str,
    outputs: list[SequenceOutput],
    prompt_tokens: int,
    fingerprint: str,
) -> dict:
    """The OpenAI output line of a finished request (one choice per sample)."""
    if raw_url == CHAT:
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": out.text},
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
                },
            },
        },
        "error": None,
        "fingerprint": fingerprint,
    }


def error_line(custom_id: str | int, message: str, fingerprint: str) -> dict:
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": None,
        "error": {"code": "invalid_request", "message": message},
        "fingerprint": fingerprint,
    }


def _finish(out: SequenceOutput) -> str:
    # OpenAI's names: an end-of-sequence token or a stop string is "stop".
    return "length" if out.finish_reason == "length" else "stop"
