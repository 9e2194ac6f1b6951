"""What each field of an OpenAI request body means to etjax: one table.

A body field is one of four kinds:

- mapped: it becomes an etjax record field (a request field by its `openai` names, see
  etjax/request_fields.py, or a sampler setting of the same meaning), read and checked as a
  record's field is, so a bad value gets the same message;
- special: read by code of its own (`logprobs`/`top_logprobs` into the record's `logprobs`,
  `stream`, vLLM's `top_k` of -1, `response_format` into the record's `json_schema`);
- ignored: accounting metadata OpenAI keeps and that changes no output (`user`, `metadata`,
  `store`, `service_tier`): accepted, and without effect here either;
- refused: a field whose meaning etjax cannot give (tool calls, logit biases, audio, ...), an
  error that names it and says why, so a line never runs with a setting silently dropped.

Anything else is an unknown field, refused with the list of known ones.
"""

from __future__ import annotations

from etjax.constraints import grammar as constraint_checks
from etjax.errors import RequestError
from etjax.request_fields import FIELDS

# Body name -> the etjax record field it becomes ("model" is only echoed back: None).
MAPPED: dict[str, str | None] = {
    "model": None,
    "messages": "messages",
    "prompt": "prompt",
    **{body: name for name, row in FIELDS.items() for body in row.openai},
    # The sampler's settings of the same meaning: OpenAI's own, then those vLLM's
    # OpenAI-compatible server adds (the files it and sglang write carry them).
    **{
        k: k
        for k in (
            "temperature",
            "top_p",
            "seed",
            "presence_penalty",
            "frequency_penalty",
            "min_p",
            "repetition_penalty",
        )
    },
}

# Read by code of their own (openai_format.py and `special_fields` below).
SPECIAL = ("logprobs", "top_logprobs", "stream", "top_k", "response_format")

IGNORED = ("user", "metadata", "store", "service_tier")

_NO_TOOLS = "etjax generates text only; it does not call tools or functions"
REFUSED: dict[str, str] = {
    "tools": _NO_TOOLS,
    "tool_choice": _NO_TOOLS,
    "parallel_tool_calls": _NO_TOOLS,
    "functions": _NO_TOOLS,
    "function_call": _NO_TOOLS,
    "logit_bias": "etjax's sampler has no per-token logit bias",
    "stream_options": "a batch job answers each request whole (body.stream must be false)",
    "modalities": "etjax generates text only",
    "audio": "etjax generates text only",
    "prediction": "predicted outputs are not supported",
    "reasoning_effort": "the model has no reasoning-effort setting",
    "web_search_options": "etjax does not search the web",
    "min_tokens": "etjax has no minimum length; generation may end at an end-of-sequence token",
    "best_of": "etjax returns every sample it draws (use n)",
    "echo": "the answer holds only the completion",
    "suffix": "etjax does not insert text",
}


def known_fields() -> list[str]:
    """Every body name a line may carry, refused ones aside."""
    return sorted([*MAPPED, *SPECIAL, *IGNORED])


def check_names(body: dict) -> None:
    """RequestError for the first refused or unknown field of `body`."""
    for name in sorted(body):
        if name in REFUSED:
            raise RequestError(f"body.{name} is not supported: {REFUSED[name]}")
    unknown = sorted(set(body) - set(known_fields()))
    if unknown:
        raise RequestError(f"body.{unknown[0]} is not supported; allowed: {known_fields()}")


def special_fields(body: dict) -> dict:
    """The record fields `stream` and `top_k` give (RequestError naming the body field)."""
    record = {}
    if body.get("stream", False) is not False:
        raise RequestError(
            f"body.stream={body['stream']!r}; a batch job answers each request whole (false)"
        )
    if "top_k" in body:
        # vLLM's and sglang's "off" is -1 (and 0); etjax's is 0. Other values are read as the
        # sampler's own top_k (checked there).
        top_k = body["top_k"]
        record["top_k"] = 0 if top_k == -1 and not isinstance(top_k, bool) else top_k
    if "response_format" in body:
        schema = _response_format(body["response_format"])
        if schema is not None:
            given = [k for k in body if MAPPED.get(k) in constraint_checks.KINDS]
            if given:
                raise RequestError(f"body.response_format and body.{given[0]} are both given")
            record["json_schema"] = schema
    return record


def _response_format(value: object) -> dict | None:
    # OpenAI's {"type": "text"} (no constraint), {"type": "json_object"} (any JSON object) or
    # {"type": "json_schema", "json_schema": {"name", "schema", "strict", ...}}: the schema.
    where = "body.response_format"
    kinds = ("text", "json_object", "json_schema")
    if not isinstance(value, dict) or value.get("type") not in kinds:
        raise RequestError(f"{where}={value!r}; must be an object with a type in {kinds}")
    if value["type"] == "text":
        return None
    if value["type"] == "json_object":
        return {"type": "object"}
    inner = value.get("json_schema")
    if not isinstance(inner, dict) or not isinstance(inner.get("schema"), dict | bool):
        raise RequestError(f"{where}.json_schema must be an object holding a schema")
    try:
        constraint_checks.json_schema(inner["schema"])
    except constraint_checks.Refused as refused:
        raise RequestError(f"{where}.json_schema.schema: must be {refused}") from None
    return inner["schema"]
