"""The four ways a request constrains its output, each turned into one llguidance grammar.

- `json_schema`: a JSON schema (an object, or its JSON text); the output is one JSON value
  that validates against it, written compactly with a space after `,` and `:` (no free
  whitespace: a small model that may emit whitespace forever otherwise does).
- `regex`: a regular expression the whole output matches (Rust `regex` syntax).
- `choices`: a list of strings; the output is exactly one of them.
- `grammar`: a context-free grammar in Lark syntax, as llguidance reads it
  (https://github.com/guidance-ai/llguidance/blob/main/docs/syntax.md), or llama.cpp's GBNF.

The grammar engine is llguidance (chosen over xgrammar by measurement: docs/ARCHITECTURE.md);
etjax compiles no regex or schema itself. Each check below is a request field's check
(etjax/request_fields.py): it returns the value as a request stores it (a schema as its JSON
text, so settings stay hashable and fingerprintable) or raises `Refused` with llguidance's
own reason, so an invalid schema is a request error naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from etjax.errors import RequestError

KINDS = ("json_schema", "regex", "choices", "grammar")

# Compact JSON: the separators a model writes by habit, and no other whitespace.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class Refused(Exception):
    """What a value must be (the request field table's Refused, without importing it)."""


def _llguidance():
    try:
        import llguidance
    except ImportError as e:  # pragma: no cover - a core dependency
        raise RequestError(
            "constrained output needs the llguidance package: pip install llguidance"
        ) from e
    return llguidance


def grammar_text(kind: str, value: str | tuple[str, ...]) -> str:
    """The llguidance grammar of a checked constraint value of `kind` (one of KINDS)."""
    llg = _llguidance()
    if kind == "json_schema":
        return llg.LLMatcher.grammar_from_json_schema(value, defaults=_JSON_OPTIONS)
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(value)
    if kind == "choices":
        return llg.grammar_from("choice", json.dumps(list(value)))
    return llg.grammar_from("grammar", value)


def _validated(kind: str, value: str | tuple[str, ...], what: str) -> None:
    try:
        error = _llguidance().LLMatcher.validate_grammar(grammar_text(kind, value))
    except ValueError as e:
        error = str(e)
    if error:
        # llguidance's reason on one line (a regex error spans several, with a caret).
        raise Refused(f"{what} ({' '.join(error.split())[:300]})")


def json_schema(value: object) -> str | None:
    """A JSON schema as an object or as JSON text -> its JSON text."""
    if value is None:
        return None
    what = "a valid JSON schema (an object, or its JSON text)"
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise Refused(f"{what} (not JSON: {e.msg})") from None
    if not isinstance(value, dict | bool):
        raise Refused(what)
    text = json.dumps(value)  # property order is the order the output writes them
    _validated("json_schema", text, what)
    return text


def regex(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise Refused("a non-empty regular expression")
    _validated("regex", value, "a valid regular expression")
    return value


def choices(value: object) -> tuple[str, ...] | None:
    if value is None:
        return None
    if (
        not isinstance(value, list | tuple)
        or not value
        or not all(isinstance(c, str) and c for c in value)
    ):
        raise Refused("a non-empty list of non-empty strings")
    return tuple(value)


def grammar(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise Refused("a grammar in Lark or GBNF syntax")
    _validated("grammar", value, "a valid grammar in Lark or GBNF syntax")
    return value


CHECKS: dict[str, Callable[[object], object]] = {
    "json_schema": json_schema,
    "regex": regex,
    "choices": choices,
    "grammar": grammar,
}
