"""`ConfigFields`: the fields of a JSON config (a config.json, a table in it), read with the
checks a model's sizes need, so that every error names the file, the field, its value and what
is allowed rather than surfacing as Python's own TypeError or ZeroDivisionError."""

from __future__ import annotations

import math
from typing import Any

from etjax.errors import ModelLoadError, shown


class ConfigFields:
    """The fields of `raw`, a JSON object read from `source`; `prefix` names the table they sit
    in ("rope_parameters."). Called as a function: the raw value, or `default` when missing
    or null (a required field when no default is given)."""

    def __init__(self, raw: dict[str, Any], source: str, prefix: str = "") -> None:
        self.raw, self.source, self.prefix = raw, source, prefix

    def __call__(self, name: str, default: Any = ...) -> Any:
        if name in self.raw and self.raw[name] is not None:
            return self.raw[name]
        if default is ...:
            raise ModelLoadError(f"{self.source}: required field {self.prefix + name!r} is missing")
        return default

    def refuse(self, name: str, value: Any, allowed: str) -> ModelLoadError:
        """The error for field `name` holding `value`, which must be `allowed`."""
        return ModelLoadError(
            f"{self.source}: {self.prefix}{name}={shown(value)}; must be {allowed}"
        )

    def count(self, name: str, default: Any = ..., minimum: int = 1) -> int:
        """An integer >= `minimum` (a float with no fraction, as some writers store, too)."""
        value = self(name, default)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.refuse(name, value, f"an integer >= {minimum}")
        return value

    def number(self, name: str, default: Any = ..., above: float | None = None) -> float:
        """A finite number (> `above` when given)."""
        value = self(name, default)
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if not ok or not math.isfinite(value) or (above is not None and not value > above):
            bound = "" if above is None else f" > {above:g}"
            raise self.refuse(name, value, f"a finite number{bound}")
        return float(value)

    def numbers(self, name: str, above: float) -> tuple[float, ...]:
        """A list of finite numbers, each > `above` (a table of RoPE factors)."""
        values = self(name)
        if not isinstance(values, list) or not all(
            isinstance(v, int | float)
            and not isinstance(v, bool)
            and math.isfinite(v)
            and v > above
            for v in values
        ):
            raise self.refuse(name, values, f"a list of finite numbers > {above:g}")
        return tuple(float(v) for v in values)

    def window(self, name: str = "sliding_window") -> int | None:
        """A sliding window: None when missing, null or 0 (none), else an integer >= 1."""
        return self.count(name, 0, minimum=0) or None

    def table(self, name: str) -> dict:
        """A JSON object, {} when missing or null."""
        value = self(name, {})
        if not isinstance(value, dict):
            raise self.refuse(name, value, "a JSON object")
        return value
