"""Input records of a batch job: one JSON object per line, validated one at a time.

Fields: "prompt" (required, a string); optional "id" (string or number; default: the line
number), "max_new_tokens", "ignore_eos", "chat", "system_prompt", "stop", "priority", and any
`SamplerSettings` field ("sampler", "temperature", "seed", "top_p", ...). Missing fields take
the run config's defaults. A record that fails validation becomes an error result; it never
stops the job.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from etjax.errors import EtjaxError, RequestError
from etjax.loaders.loaded_model import Model
from etjax.request_checks import positive_int, sampler_settings, stop_strings, tokenize_prompt
from etjax.run_config import RunConfig
from etjax.runtime.options import RequestSettings

_REQUEST_FIELDS = {"id", "prompt", "max_new_tokens", "ignore_eos", "chat", "system_prompt"}
_REQUEST_FIELDS |= {"stop", "priority"}


@dataclass
class ParsedRecord:
    id: str
    line: int  # 1-based line number in the input
    prompt_ids: list[int] | None = None
    settings: RequestSettings | None = None
    priority: float = 0.0
    error: str | None = None


def record_id(raw: object, line: int) -> str:
    """The id a line's result carries: its "id" field if usable, else its line number."""
    if isinstance(raw, dict) and isinstance(raw.get("id"), str | int) and raw.get("id") != "":
        return str(raw["id"])
    return str(line)


def parse_record(text: str, line: int, model: Model, config: RunConfig) -> ParsedRecord:
    """Validate one input line against the model and the config's defaults."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        return ParsedRecord(str(line), line, error=f"line {line}: not valid JSON ({e.msg})")
    rec = ParsedRecord(record_id(raw, line), line)
    if not isinstance(raw, dict):
        rec.error = f"line {line}: a record must be a JSON object, got {type(raw).__name__}"
        return rec
    try:
        rec.settings, chat, system = _settings(raw, config)
        priority = raw.get("priority", 0.0)
        if isinstance(priority, bool) or not isinstance(priority, int | float):
            raise RequestError(f"priority={priority!r}; must be a number")
        rec.priority = float(priority)
        if "prompt" not in raw:
            raise RequestError('missing "prompt"')
        ids, error = tokenize_prompt(
            model, raw["prompt"], line, chat, system, rec.settings.max_new_tokens
        )
        if error is not None:
            raise RequestError(error)
        rec.prompt_ids = ids
    except EtjaxError as e:
        rec.error = f"line {line}: {e}"
    return rec


def _settings(raw: dict, config: RunConfig) -> tuple[RequestSettings, bool, str | None]:
    d = config.request
    sampler_fields = {f.name for f in dataclasses.fields(config.sampler)}
    unknown = sorted(set(raw) - _REQUEST_FIELDS - sampler_fields)
    if unknown:
        raise RequestError(
            f"unknown field {unknown[0]!r}; allowed: {sorted(_REQUEST_FIELDS | sampler_fields)}"
        )
    overrides = {k: raw[k] for k in sampler_fields if k in raw}
    base = dataclasses.asdict(config.sampler) | overrides
    sampler = sampler_settings(base.pop("sampler"), base.pop("temperature"), base.pop("seed"), base)
    chat = raw.get("chat", d.chat)
    ignore_eos = raw.get("ignore_eos", d.ignore_eos)
    for name, value in (("chat", chat), ("ignore_eos", ignore_eos)):
        if not isinstance(value, bool):
            raise RequestError(f"{name}={value!r}; must be true or false")
    system = raw.get("system_prompt", d.system_prompt)
    if system is not None and not isinstance(system, str):
        raise RequestError(f"system_prompt={system!r}; must be a string")
    settings = RequestSettings(
        max_new_tokens=positive_int("max_new_tokens", raw.get("max_new_tokens", d.max_new_tokens)),
        ignore_eos=ignore_eos,
        stop=stop_strings(raw.get("stop", list(d.stop) or None)),
        sampler=sampler,
    )
    return settings, chat, system
