"""The calibration file: a small JSON document, data only, validated field by field on load.

    {"format": "etjax-calibration", "version": 1,
     "model": "smollm2-135m-instruct", "vocab_size": 49152,
     "temperature": 1.04, "ramp_shift": 0.35,
     "fit": {"tokens": 4096, "nll_before": 3.01, "nll_after": 2.99, ...}}

`temperature` is the calibration; `ramp_shift` (nats, optional, 0 when absent) moves the
pruning ramp's thresholds onto the calibrated scale so that the default setting keeps, on the
fit text, the budget it keeps on the raw signal (etjax/calibration/ramp.py); `model` and
`vocab_size` say what it was fitted for (a file for another vocabulary is refused); `fit`
records how it was fitted and what it measured (free-form numbers and strings, never read
back into the engine).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from etjax.errors import CalibrationError

FORMAT = "etjax-calibration"
VERSION = 1
# A temperature outside this range is not a calibration but a broken fit (or file).
MIN_TEMPERATURE, MAX_TEMPERATURE = 0.05, 20.0
# A ramp shift beyond this is not a pairing but a broken fit or file: the entropy of even a
# 262K-token vocabulary (Gemma 3) is at most 12.5 nats.
MAX_RAMP_SHIFT = 16.0
_FIELDS = {"format", "version", "model", "vocab_size", "temperature", "ramp_shift", "fit"}
# Optional: a file written by hand may state only a temperature (its ramp then unshifted).
_OPTIONAL = {"ramp_shift", "fit"}


@dataclass(frozen=True)
class Calibration:
    """A fitted calibration of a model's entropy signal (etjax/calibration/signal.py).

    temperature: the entropy signal is that of softmax(logits / temperature).
    model, vocab_size: the model it was fitted for. fit: how, and what it measured.
    ramp_shift: nats added to the pruning ramp's thresholds while this calibration is loaded
      (etjax/calibration/ramp.py: the shift that keeps the default budget on the fit text).
    """

    temperature: float
    model: str
    vocab_size: int
    fit: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    ramp_shift: float = 0.0

    def __post_init__(self) -> None:
        _check_temperature(self.temperature, "Calibration")
        _check_ramp_shift(self.ramp_shift, "Calibration.ramp_shift")

    def to_json(self) -> dict[str, Any]:
        """The file's document."""
        return {
            "format": FORMAT,
            "version": VERSION,
            "model": self.model,
            "vocab_size": self.vocab_size,
            "temperature": self.temperature,
            "ramp_shift": self.ramp_shift,
            "fit": self.fit,
        }


def save_calibration(calibration: Calibration, path: str | Path) -> Path:
    """Write `calibration` to `path` as JSON (the parent folder must exist). Returns the path."""
    path = Path(path)
    if not path.parent.is_dir():
        raise CalibrationError(f"{path}: folder {path.parent} does not exist")
    path.write_text(json.dumps(calibration.to_json(), indent=2) + "\n")
    return path


def load_calibration(path: str | Path, vocab_size: int | None = None) -> Calibration:
    """Read and validate a calibration file; with `vocab_size`, refuse one fitted for a model
    of another vocabulary. Raises CalibrationError naming the file, field and value at fault."""
    path = Path(path)
    if not path.is_file():
        raise CalibrationError(f"{path}: calibration file not found")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CalibrationError(f"{path}: not a JSON calibration file ({e})") from None
    if not isinstance(doc, dict):
        raise CalibrationError(f"{path}: expected a JSON object, got {type(doc).__name__}")
    unknown = sorted(set(doc) - _FIELDS)
    if unknown:
        raise CalibrationError(f"{path}: unknown field {unknown[0]!r}; allowed: {sorted(_FIELDS)}")
    missing = sorted(_FIELDS - _OPTIONAL - set(doc))
    if missing:
        raise CalibrationError(f"{path}: missing field {missing[0]!r}")
    if doc["format"] != FORMAT:
        raise CalibrationError(f"{path}: field 'format' = {doc['format']!r}; must be {FORMAT!r}")
    if doc["version"] != VERSION or isinstance(doc["version"], bool):
        raise CalibrationError(
            f"{path}: field 'version' = {doc['version']!r}; this etjax reads version {VERSION}"
        )
    if not isinstance(doc["model"], str):
        raise CalibrationError(f"{path}: field 'model' = {doc['model']!r}; must be a string")
    size = doc["vocab_size"]
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise CalibrationError(f"{path}: field 'vocab_size' = {size!r}; must be a positive integer")
    if vocab_size is not None and size != vocab_size:
        raise CalibrationError(
            f"{path}: field 'vocab_size' = {size} but the model has {vocab_size} tokens: "
            f"this calibration was fitted for another model ({doc['model']!r})"
        )
    _check_temperature(doc["temperature"], f"{path}: field 'temperature'")
    shift = doc.get("ramp_shift", 0.0)
    _check_ramp_shift(shift, f"{path}: field 'ramp_shift'")
    fit = doc.get("fit", {})
    if not isinstance(fit, dict) or not all(
        isinstance(v, str | int | float | bool) or v is None for v in fit.values()
    ):
        raise CalibrationError(
            f"{path}: field 'fit' = {fit!r}; must be an object of numbers and strings"
        )
    return Calibration(float(doc["temperature"]), doc["model"], size, fit, float(shift))


def _check_temperature(value: Any, where: str) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not MIN_TEMPERATURE <= value <= MAX_TEMPERATURE:
        raise CalibrationError(
            f"{where} = {value!r}; must be a number in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}]"
        )


def _check_ramp_shift(value: Any, where: str) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or abs(value) > MAX_RAMP_SHIFT:
        raise CalibrationError(
            f"{where} = {value!r}; must be a number of nats in "
            f"[{-MAX_RAMP_SHIFT}, {MAX_RAMP_SHIFT}]"
        )
