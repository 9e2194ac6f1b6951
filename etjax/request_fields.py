"""Every request field, described once.

A request field (how long to generate, when to stop, how to read the prompt, ...) is one
dataclass field below, with its type and default, and its `request_field` metadata: the check
its value must pass, its help text and the doors it may come in by:

    decode   an `etjax.decode()` keyword (api.py writes it out, so IDEs and `help()` show it;
             tests/test_request_fields.py holds the signature to this table)
    record   a field of a batch-job record (etjax/jobs/records.py)
    openai   the names an OpenAI Batch API body gives it (etjax/jobs/openai_format.py)
    toml     a key of a run config's [request] table: its default for a job (etjax/run_config.py)
    cli      an `etjax generate` flag (etjax/generate_command.py)

Each door reads its values through `read_fields`, so a bad value is the same `FieldError`
(naming the field, the value and what is allowed) whichever door it came by; a config file
adds its path and table. `RequestSettings` holds what the engine needs for one request and
checks itself as `SamplerSettings` does; `PromptSettings` holds how the prompt is read and
served. Adding a request field is three edits: its line in one of the two classes, its
`decode()` keyword, and the code where it acts.

The sampler's own settings (`SamplerSettings`: sampler, temperature, top_p, seed, ...) are a
table of their own in etjax/sampling/settings.py, read by the same doors.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from etjax.constraints import grammar as constraint_checks
from etjax.errors import FieldError, RequestError
from etjax.sampling.settings import SamplerSettings

DECODE, RECORD, TOML, CLI = "decode", "record", "toml", "cli"
DOORS = (DECODE, RECORD, TOML, CLI)  # "openai" is the `openai` names, not a door of its own
DOOR_NAMES = {
    DECODE: "a decode() keyword",
    RECORD: "a batch-record field",
    TOML: "a run config's [request] key",
    CLI: "an `etjax generate` flag",
}


_TOO_DEEP = "nested less deeply (this one runs past Python's recursion limit)"


class Refused(Exception):
    """Raised by a check: what is allowed, as Python (`python`) and as JSON or TOML spell it."""

    def __init__(self, python: str, json: str | None = None) -> None:
        super().__init__(python)
        self.python, self.json = python, python if json is None else json


@dataclass(frozen=True)
class RequestField:
    """One request field: its name, type (the annotation), default, check and help, and the
    doors it is open at. `check(value)` returns the value as the engine takes it (a list of
    stop strings as a tuple, an integer priority as a float) or raises `Refused`."""

    name: str
    type: str
    default: object
    check: Callable[[object], object]
    help: str
    doors: frozenset[str]
    openai: tuple[str, ...] = ()  # body names of an OpenAI batch line, first the main one
    flags: tuple[str, ...] = ()  # the `etjax generate` flags (with the cli door)

    def read(self, value: object, door: str = DECODE) -> object:
        """The checked value, or `FieldError` naming the field, the value and what is
        allowed (spelled as the door's language spells it: True in Python, true in JSON)."""
        try:
            return self.check(value)
        except Refused as refused:
            allowed = refused.python if door in (DECODE, CLI) else refused.json
            raise FieldError(self.name, value, allowed) from None
        except RecursionError:  # JSON text or an object nested past Python's recursion limit
            raise FieldError(self.name, value, _TOO_DEEP) from None


def request_field(
    default: object,
    check: Callable[[object], object],
    help: str,
    doors: tuple[str, ...] = DOORS,
    openai: tuple[str, ...] = (),
    flags: tuple[str, ...] | None = None,
) -> dataclasses.Field:
    """A dataclass field that is a request field (the row's name, type and default are the
    dataclass field's own); `flags` default to `--name-with-dashes` when the cli door is open."""
    spec = {"check": check, "help": help, "doors": frozenset(doors), "openai": openai}
    spec["flags"] = flags if flags is not None else ()
    return field(default=default, metadata={"request": spec})


def _rows(cls: type) -> dict[str, RequestField]:
    rows = {}
    for f in dataclasses.fields(cls):
        if "request" not in f.metadata:
            continue
        spec = dict(f.metadata["request"])
        if CLI in spec["doors"] and not spec["flags"]:
            spec["flags"] = ("--" + f.name.replace("_", "-"),)
        rows[f.name] = RequestField(f.name, str(f.type), f.default, **spec)
    return rows


def _check_rows(obj: object) -> None:
    # What __post_init__ of the classes holding request fields runs: every field checked, and
    # stored as checked (a list of stop strings as a tuple).
    for f in dataclasses.fields(obj):
        if f.name in FIELDS:
            object.__setattr__(obj, f.name, FIELDS[f.name].read(getattr(obj, f.name)))


def checked(name: str, value: object, check: Callable[[object], object], door: str = DECODE):
    """`check(value)` for a setting that is no request field (an engine size of `decode()`),
    raising `FieldError` as a request field's check does."""
    return RequestField(name, "", None, check, "", frozenset()).read(value, door)


# The checks. Each returns the value as stored, or raises Refused with what is allowed.


def positive_int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise Refused("a positive integer")
    return value


def switch(value: object) -> bool:
    # A bool, nothing else: "no" is a non-empty string, hence truthy.
    if not isinstance(value, bool):
        raise Refused("True or False", "true or false")
    return value


def text_or_none(value: object) -> str | None:
    if value is not None and not isinstance(value, str):
        raise Refused("a string or None", "a string or null")
    return value


def stop_strings(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not all(isinstance(s, str) and s for s in items):
        raise Refused("a non-empty string or a list of non-empty strings")
    return tuple(items)


MAX_SAMPLES = 128  # samples of one prompt (`n`), as the OpenAI API allows


def sample_count(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SAMPLES:
        raise Refused(f"an integer from 1 to {MAX_SAMPLES}")
    return value


MAX_LOGPROBS = 20  # top log-probabilities per generated token, as the OpenAI API allows


def logprob_count(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS:
        raise Refused(f"an integer from 0 to {MAX_LOGPROBS}")
    return value


def _constraint(kind: str) -> Callable[[object], object]:
    # A constraint's check (etjax/constraints/grammar.py), its refusal as this table's.
    def check(value: object) -> object:
        try:
            return constraint_checks.CHECKS[kind](value)
        except constraint_checks.Refused as refused:
            text = str(refused)
            raise Refused(text) from None

    return check


def finite_number(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise Refused("a finite number")
    return float(value)


@dataclass(frozen=True)
class RequestSettings:
    """What the engine needs to run one request: how long, when it stops, how it samples."""

    max_new_tokens: int = request_field(
        128,
        positive_int,
        "tokens to generate at most (>= 1)",
        openai=("max_tokens", "max_completion_tokens"),
    )
    ignore_eos: bool = request_field(
        False,
        switch,
        "keep generating past end-of-sequence tokens (exactly max_new_tokens)",
        openai=("ignore_eos",),  # vLLM's name in an OpenAI body
    )
    stop: tuple[str, ...] = request_field(
        (),
        stop_strings,
        "strings that end generation; the text is cut before them",
        openai=("stop",),
    )
    logprobs: int = request_field(
        0,
        logprob_count,
        f"the k most likely (token id, log-probability) pairs at each generated token, "
        f"at temperature 1 before penalties (0 to {MAX_LOGPROBS}; 0: none)",
        doors=(DECODE, RECORD, TOML),
    )
    prompt_logprobs: bool = request_field(
        False,
        switch,
        "each prompt token's log-probability given the tokens before it, at temperature 1 "
        "(None for the first); such a prompt is prefilled whole, not served by the prefix cache",
        doors=(DECODE, RECORD, TOML),
    )
    # Constrained output, one kind per request (etjax/constraints/grammar.py).
    json_schema: str | None = request_field(
        None,
        _constraint("json_schema"),
        "a JSON schema (an object or its JSON text) the output is a JSON value of; "
        "written compactly",
        doors=(DECODE, RECORD),
        openai=("guided_json",),  # vLLM's name; OpenAI's response_format is read apart
    )
    regex: str | None = request_field(
        None,
        _constraint("regex"),
        "a regular expression the whole output matches",
        doors=(DECODE, RECORD),
        openai=("guided_regex",),
    )
    choices: tuple[str, ...] | None = request_field(
        None,
        _constraint("choices"),
        "strings the output is exactly one of",
        doors=(DECODE, RECORD),
        openai=("guided_choice",),
    )
    grammar: str | None = request_field(
        None,
        _constraint("grammar"),
        "a context-free grammar (llguidance's Lark syntax, or GBNF) the output follows",
        doors=(DECODE, RECORD),
        openai=("guided_grammar",),
    )
    sampler: SamplerSettings = field(default_factory=SamplerSettings)

    def __post_init__(self) -> None:
        _check_rows(self)
        if not isinstance(self.sampler, SamplerSettings):
            raise FieldError("sampler", self.sampler, "a SamplerSettings")
        given = [kind for kind in constraint_checks.KINDS if getattr(self, kind) is not None]
        if len(given) > 1:
            raise RequestError(f"{given[0]} and {given[1]} are both given; a request takes one")
        if given and self.ignore_eos:
            # The grammar ends the output with an end-of-sequence token.
            raise RequestError(f"{given[0]} and ignore_eos are both given; a grammar ends at eos")

    @property
    def constraint(self) -> tuple[str, object] | None:
        """(kind, value) of the request's constraint, or None."""
        for kind in constraint_checks.KINDS:
            if getattr(self, kind) is not None:
                return kind, getattr(self, kind)
        return None


@dataclass(frozen=True)
class PromptSettings:
    """How one request's prompt is read and served: its chat template, how many samples it
    draws and its place in the queue. None of them reaches the engine as a setting: chat and
    system_prompt shape the prompt's tokens (fingerprinted as tokens), n is fingerprinted on
    its own and priority changes no output."""

    chat: bool = request_field(False, switch, "wrap the prompt as a user turn in the chat template")
    system_prompt: str | None = request_field(
        None,
        text_or_none,
        "a system turn with chat, or before a conversation that has none",
        flags=("--system", "--system-prompt"),
    )
    # A property of where the input comes from: a config key and a decode() keyword, never a
    # record field (a record cannot vouch for itself).
    trusted_chat: bool = request_field(
        False,
        switch,
        "with chat, parse special-token text inside prompts (and the system prompt) as special "
        "tokens; off, a prompt holding <|im_start|>system is that text and opens no turn",
        doors=(DECODE, TOML),
    )
    n: int = request_field(
        1,
        sample_count,
        "samples of the prompt, each with its own seed (the prefix cache prefills the prompt "
        "once for all of them)",
        doors=(DECODE, RECORD, CLI),
        openai=("n",),
        flags=("-n",),
    )
    priority: float = request_field(
        0.0, finite_number, "queue order under the priority policy (higher first)", doors=(RECORD,)
    )

    def __post_init__(self) -> None:
        _check_rows(self)


# The RequestSettings fields of the first fingerprinted release, always hashed into a batch
# record's fingerprint; a field added since is hashed only away from its default
# (`canonical_settings`, etjax/jobs/records.py).
SETTINGS_SINCE_0_1 = ("max_new_tokens", "ignore_eos", "stop", "sampler")

FIELDS: dict[str, RequestField] = _rows(RequestSettings) | _rows(PromptSettings)
_SETTINGS = _rows(RequestSettings).keys()


def open_at(door: str) -> dict[str, RequestField]:
    """The request fields a door takes, in table order."""
    return {name: row for name, row in FIELDS.items() if door in row.doors}


def read_fields(
    given: Mapping[str, object], door: str, defaults: Mapping[str, object] | None = None
) -> dict[str, object]:
    """Every request field's value: the checked value `given` at `door`, else its default
    (from `defaults`, a run config's [request] table, then the table's own). A field closed
    at the door is a `RequestError` saying where it may be set."""
    values = {}
    for name, row in FIELDS.items():
        if name in given:
            if door not in row.doors:
                where = " or ".join(DOOR_NAMES[d] for d in DOORS if d in row.doors)
                raise RequestError(f"{name} is not {DOOR_NAMES[door]}; it is {where}")
            values[name] = row.read(given[name], door)
        elif defaults is not None and name in defaults:
            values[name] = defaults[name]
        else:
            values[name] = row.default
    return values


def build_request(
    values: Mapping[str, object], sampler: SamplerSettings
) -> tuple[RequestSettings, PromptSettings]:
    """The two halves of a request from `read_fields`' values."""
    settings = RequestSettings(sampler=sampler, **{k: values[k] for k in _SETTINGS})
    prompt = PromptSettings(**{k: v for k, v in values.items() if k not in _SETTINGS})
    return settings, prompt


def _defaults_class() -> type:
    # [request] of a run config: the fields open at the toml door, checked as the table says.
    rows = open_at(TOML)
    cls = dataclasses.make_dataclass(
        "RequestDefaults",
        [(name, row.type, field(default=row.default)) for name, row in rows.items()],
        frozen=True,
        namespace={"__post_init__": _check_rows, "__doc__": "A run config's [request] table."},
    )
    cls.__module__ = __name__
    return cls


RequestDefaults = _defaults_class()
