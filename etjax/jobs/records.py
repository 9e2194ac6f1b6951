"""Input records of a batch job: one JSON object per line, validated one at a time.

Fields: "prompt" (a string) or "messages" (a list of {"role", "content"} objects, rendered
by the model's chat template); optional "id" (a non-empty string or an integer,
written back as a string; without one, a record is known by its line number, written back as
a JSON number, so a generated id never equals a given one), every request field open to
records (etjax/request_fields.py: "max_new_tokens", "stop", ...), and any `SamplerSettings`
field ("sampler", "temperature", "seed", "top_p", ...). Missing fields take the run config's
defaults ([request] and [sampler]), but for
"seed": a record without one samples from a stream of its own, derived from the config's seed
and its id, and its result says which seed that was. A record
that fails validation becomes an error result; it never stops the job. So does a record holding
a string that is no Unicode text anywhere (JSON's "\\ud800", a lone surrogate, which no UTF-8
file holds): the error names where, and such an id gives way to the line number. Each record
carries a fingerprint of what its result depends on, so a rerun can tell a changed record from a
done one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass

from etjax.errors import EtjaxError, RequestError
from etjax.jobs import openai_format
from etjax.loaders.loaded_model import Model
from etjax.request_checks import derived_seed, sampler_settings, seed_value, tokenize_prompt
from etjax.request_fields import (
    FIELDS,
    RECORD,
    SETTINGS_SINCE_0_1,
    PromptSettings,
    RequestSettings,
    build_request,
    open_at,
    read_fields,
)
from etjax.run_config import RunConfig
from etjax.sampling.settings import SamplerSettings

# A record's own fields, then the request fields open to records (etjax/request_fields.py).
REQUEST_FIELDS = {"id", "prompt", "messages", *open_at(RECORD)}


RecordId = str | int  # a given id (always a string) or a line number (always an int)


@dataclass
class ParsedRecord:
    id: RecordId
    line: int  # 1-based line number in the input
    prompt_ids: list[int] | None = None
    settings: RequestSettings | None = None
    priority: float = 0.0
    error: str | None = None
    fingerprint: str = ""  # of what the result depends on (`request_fingerprint`)
    n: int = 1  # samples of the prompt, each with its own seed (`sample_seeds`)
    openai_url: str | None = None  # an OpenAI batch line: answered in that format
    openai_model: str | None = None  # the model its body named, echoed back
    openai_logprobs: bool = False  # its body asked for logprobs: the answer carries them

    def sample_seeds(self) -> list[int]:
        """The seed of each sample: the record's own for one, one stream each for several."""
        seed = self.settings.sampler.seed
        return [seed] if self.n == 1 else [derived_seed(seed, j) for j in range(self.n)]


def record_id(raw: object, line: int) -> tuple[RecordId, str | None]:
    """The id a line's result carries, and an error if its "id" field is unusable: a given
    non-empty string or integer (as a string), an OpenAI line's "custom_id" (a non-empty
    string), else the line number (as an int). A string that is no Unicode text (it holds a
    lone surrogate) is unusable: no results file could hold it."""
    if isinstance(raw, dict) and "custom_id" in raw:
        value = raw["custom_id"]
        if isinstance(value, str) and value != "" and _surrogate(value) is None:
            return value, None
        return line, _id_error(line, "custom_id", value, "a non-empty string")
    if not isinstance(raw, dict) or "id" not in raw:
        return line, None
    value = raw["id"]
    if isinstance(value, str) and value != "" and _surrogate(value) is None:
        return value, None
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value), None
    return line, _id_error(line, "id", value, "a non-empty string or an integer")


def _id_error(line: int, name: str, value: object, allowed: str) -> str:
    at = _surrogate(value) if isinstance(value, str) else None
    if at is None:
        return f"line {line}: {name}={shown(value)}; must be {allowed}"
    return (
        f"line {line}: {name} holds a lone surrogate {value[at]!r} at character {at}; "
        "an id must be Unicode text"
    )


def shown(value: object, limit: int = 120) -> str:
    """`repr(value)`, cut to about `limit` characters: an error quoting a 1 MB value stays a
    line a person can read."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _surrogate(text: str) -> int | None:
    # Where `text` holds a lone surrogate (JSON's "\ud800" decodes to one): no UTF-8 file
    # can hold it, so it is no text.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


# A JSON escape of a surrogate code point: a line without one decodes to no lone surrogate
# (UTF-8 bytes cannot hold one), so only lines with one are walked (`surrogate_error`).
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def surrogate_error(raw: object) -> str | None:
    """Where a decoded record holds a string that is no Unicode text (a value or a field
    name with a lone surrogate), or None. Iterative: a record may nest as deeply as JSON
    decoding allows."""
    stack: list[tuple[object, str]] = [(raw, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            at = _surrogate(value)
            if at is not None:
                return f"{path} holds a lone surrogate {value[at]!r} at character {at}"
        elif isinstance(value, list):
            stack.extend((value[i], f"{path}[{i}]") for i in reversed(range(len(value))))
        elif isinstance(value, dict):
            for name in value:
                at = _surrogate(name)
                if at is not None:
                    where = f" in {path}" if path else ""
                    return (
                        f"a field name{where} holds a lone surrogate {name[at]!r} at character {at}"
                    )
            stack.extend(
                (item, f"{path}.{name}" if path else name) for name, item in reversed(value.items())
            )
    return None


# The settings fields of the first fingerprinted release: always hashed, so that results
# files written since keep their fingerprints. A field added after them is hashed only when it
# differs from its default: an upgrade that brings a new setting, left at its default, does not
# turn every stored result into a "changed" record (a field whose default itself changes later
# would go unnoticed; change a default by adding a field instead).
FINGERPRINTED_SINCE_0_1 = {
    RequestSettings: SETTINGS_SINCE_0_1,
    SamplerSettings: (
        "sampler", "temperature", "top_k", "top_p", "min_p", "typical_p", "repetition_penalty",
        "presence_penalty", "frequency_penalty", "seed", "mirostat_tau", "mirostat_eta", "edt_t0",
        "edt_theta", "edt_base", "target_entropy", "t_min", "t_max", "gain", "max_step",
        "entropy_floor",
    ),
}  # fmt: skip


def canonical_settings(settings: object) -> object:
    """The form of `settings` a fingerprint hashes: as `dataclasses.asdict` for the fields of
    `FINGERPRINTED_SINCE_0_1`, without later fields left at their defaults."""
    if not dataclasses.is_dataclass(settings):
        return list(settings) if isinstance(settings, tuple) else settings
    since = next((FINGERPRINTED_SINCE_0_1[c] for c in type(settings).__mro__ if c in
                  FINGERPRINTED_SINCE_0_1), ())  # fmt: skip
    described = {}
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        if f.name not in since and value == _default(f):
            continue
        described[f.name] = canonical_settings(value)
    return described


def _default(f: dataclasses.Field) -> object:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING  # a required field: always hashed


def request_fingerprint(
    prompt_ids: list[int], settings: RequestSettings, n: int = 1, form: str | None = None
) -> str:
    """A digest of the prompt's tokens and everything that shapes the result (settings, the
    number of samples, the output format): a rerun whose record hashes differently would not
    reproduce the stored result."""
    described = {"prompt": prompt_ids, "settings": canonical_settings(settings)}
    if n != 1 or form is not None:
        described |= {"n": n, "format": form}
    described = json.dumps(described, sort_keys=True)
    return hashlib.sha256(described.encode()).hexdigest()[:16]


def parse_record(text: str, line: int, model: Model, config: RunConfig) -> ParsedRecord:
    """Validate one input line against the model and the config's defaults."""
    broken = "line:" + hashlib.sha256(text.encode("utf-8", "replace")).hexdigest()[:16]
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        return ParsedRecord(
            line, line, error=f"line {line}: not valid JSON ({e.msg})", fingerprint=broken
        )
    except RecursionError:
        return ParsedRecord(
            line, line, error=f"line {line}: JSON nested too deeply", fingerprint=broken
        )
    key, id_error = record_id(raw, line)
    rec = ParsedRecord(key, line, fingerprint=broken)
    if openai_format.is_openai(raw):  # answered in that format, its errors too
        rec.openai_url = raw["url"] if isinstance(raw.get("url"), str) else ""
    if id_error is not None:
        rec.error = id_error
        return rec
    if not isinstance(raw, dict):
        rec.error = f"line {line}: a record must be a JSON object, got {type(raw).__name__}"
        return rec
    if SURROGATE_ESCAPE.search(text) and (where := surrogate_error(raw)) is not None:
        rec.error = _cut(f"line {line}: {where}; a record's strings must be Unicode text")
        return rec
    try:
        if rec.openai_url is not None:
            body = raw.get("body")
            raw = openai_format.to_record(raw)
            rec.openai_model = body.get("model") if isinstance(body, dict) else None
            rec.openai_logprobs = openai_format.wants_logprobs(body)
        rec.settings, asked = _request(raw, config, key)
        rec.n, rec.priority = asked.n, asked.priority
        if "prompt" not in raw and "messages" not in raw:
            raise RequestError('missing "prompt" (a string) or "messages" (a list)')
        if "prompt" in raw and "messages" in raw:
            raise RequestError('"prompt" and "messages" are both given; use one')
        prompt = raw["prompt"] if "prompt" in raw else raw["messages"]
        if "prompt" in raw and not isinstance(prompt, str):
            raise RequestError(f'"prompt" is a {type(prompt).__name__}; must be a string')
        if "messages" in raw and not isinstance(prompt, list):
            raise RequestError(f'"messages" is a {type(prompt).__name__}; must be a list')
        ids, error = tokenize_prompt(
            model,
            prompt,
            line,
            asked.chat,
            asked.system_prompt,
            rec.settings.max_new_tokens,
            asked.trusted_chat,
            config.options.context_limit(model.config.max_position_embeddings),
        )
        if error is not None:
            raise RequestError(error)
        rec.prompt_ids = ids
        # logprobs: true shapes the answer even with top_logprobs 0 (k = 0 in the settings).
        form = rec.openai_url
        if rec.openai_logprobs:
            form = f"{form}+logprobs"
        rec.fingerprint = request_fingerprint(ids, rec.settings, rec.n, form)
    except EtjaxError as e:
        rec.error = _cut(f"line {line}: {e}")
    return rec


MAX_ERROR = 4000  # characters of a record's error message


def _cut(error: str) -> str:
    # An error quoting a 1 MB value (a field name, a setting): the result line stays readable.
    if len(error) <= MAX_ERROR:
        return error
    return f"{error[:MAX_ERROR]}... ({len(error) - MAX_ERROR} more characters)"


def _request(raw: dict, config: RunConfig, key: RecordId) -> tuple[RequestSettings, PromptSettings]:
    sampler_fields = {f.name for f in dataclasses.fields(config.sampler)}
    unknown = sorted(set(raw) - REQUEST_FIELDS - sampler_fields)
    if unknown:
        raise RequestError(
            f"unknown field {unknown[0]!r}; allowed: {sorted(REQUEST_FIELDS | sampler_fields)}"
        )
    overrides = {k: raw[k] for k in sampler_fields if k in raw}
    base = dataclasses.asdict(config.sampler) | overrides
    if "seed" not in raw:
        # Each record its own stream, the same on every rerun: derived from the config's
        # seed and the record's id (identical prompts do not sample identical texts).
        base["seed"] = derived_seed(seed_value(config.sampler.seed), key)
    sampler = sampler_settings(base.pop("sampler"), base.pop("temperature"), base.pop("seed"), base)
    given = {k: v for k, v in raw.items() if k in FIELDS}
    defaults = dataclasses.asdict(config.request)
    return build_request(read_fields(given, RECORD, defaults), sampler)
