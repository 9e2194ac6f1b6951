"""The calibration file: a small JSON document, data only, validated field by field on load.

    {"format": "etjax-calibration", "version": 2,
     "model": "smollm2-135m-instruct", "vocab_size": 49152,
     "model_identity": {"architecture": "llama", "vocab_size": 49152, "hidden_size": 576,
                        ..., "weights": "sha256:3f0c9d1e2a4b5c6d"},
     "temperature": 1.04, "ramp_shift": 0.35,
     "fit": {"tokens": 4096, "nll_before": 3.01, "nll_after": 2.99, ...}}

`temperature` is the calibration; `ramp_shift` (nats, optional, 0 when absent) moves the
pruning ramp's thresholds onto the calibrated scale so that the default setting keeps, on the
fit text, the budget it keeps on the raw signal (etjax/calibration/ramp.py); `model` (a
name, for people) and `vocab_size` say what it was fitted for, and `model_identity` which
model exactly (etjax/calibration/identity.py: its architecture, sizes and a fingerprint of
its weights): a file for another vocabulary, or of another identity, is refused. `fit`
records how it was fitted and what it measured (free-form numbers and strings, never read
back into the engine).

Version 1 files, written before the identity was recorded, still load: they are checked
against the vocabulary alone, with a warning saying so. Refusing them would break every
preset that names one, for no proof that it is wrong; the warning says how to get the check
(fit it again).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from etjax.errors import CalibrationError, shown

log = logging.getLogger(__name__)

FORMAT = "etjax-calibration"
VERSION = 2  # with `model_identity`; version 1 files (without it) load with a warning
READ_VERSIONS = (1, 2)
# A temperature outside this range is not a calibration but a broken fit (or file).
MIN_TEMPERATURE, MAX_TEMPERATURE = 0.05, 20.0
# A ramp shift beyond this is not a pairing but a broken fit or file: the entropy of even a
# 262K-token vocabulary (Gemma 3) is at most 12.5 nats.
MAX_RAMP_SHIFT = 16.0
_FIELDS = {
    "format",
    "version",
    "model",
    "vocab_size",
    "model_identity",
    "temperature",
    "ramp_shift",
    "fit",
}
# Optional: a file written by hand may state only a temperature (its ramp then unshifted).
_OPTIONAL = {"ramp_shift", "fit", "model_identity"}


@dataclass(frozen=True)
class Calibration:
    """A fitted calibration of a model's entropy signal (etjax/calibration/signal.py).

    temperature: the entropy signal is that of softmax(logits / temperature).
    model, vocab_size: the model it was fitted for. fit: how, and what it measured.
    ramp_shift: nats added to the pruning ramp's thresholds while this calibration is loaded
      (etjax/calibration/ramp.py: the shift that keeps the default budget on the fit text).
    identity: `identity.model_identity` of the model it was fitted on; None for one made by
      hand (saved as a version 1 file, checked against the vocabulary alone).
    """

    temperature: float
    model: str
    vocab_size: int
    fit: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    ramp_shift: float = 0.0
    identity: dict[str, str | int] | None = field(default=None, compare=False, hash=False)

    def __post_init__(self) -> None:
        _check_temperature(self.temperature, "Calibration")
        _check_ramp_shift(self.ramp_shift, "Calibration.ramp_shift")

    def to_json(self) -> dict[str, Any]:
        """The file's document (version 1 when it has no identity to record)."""
        doc = {
            "format": FORMAT,
            "version": VERSION if self.identity is not None else 1,
            "model": self.model,
            "vocab_size": self.vocab_size,
            "model_identity": self.identity,
            "temperature": self.temperature,
            "ramp_shift": self.ramp_shift,
            "fit": self.fit,
        }
        return {k: v for k, v in doc.items() if v is not None}


def save_calibration(calibration: Calibration, path: str | Path) -> Path:
    """Write `calibration` to `path` as JSON (the parent folder must exist). Returns the path."""
    path = Path(path)
    if not path.parent.is_dir():
        raise CalibrationError(f"{path}: folder {path.parent} does not exist")
    path.write_text(json.dumps(calibration.to_json(), indent=2) + "\n")
    return path


def load_calibration(
    path: str | Path,
    vocab_size: int | None = None,
    identity: dict[str, str | int] | None = None,
    model_name: str | None = None,
) -> Calibration:
    """Read and validate a calibration file; with `vocab_size`, refuse one fitted for a model
    of another vocabulary, and with `identity` (`identity.model_identity` of the model it is
    loaded with, named `model_name`) one fitted for another model. Raises CalibrationError
    naming the file, field and value at fault."""
    path = Path(path)
    if not path.is_file():
        raise CalibrationError(f"{path}: calibration file not found")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CalibrationError(f"{path}: not a JSON calibration file ({e})") from None
    except RecursionError:
        raise CalibrationError(f"{path}: JSON nested too deeply to read") from None
    if not isinstance(doc, dict):
        raise CalibrationError(f"{path}: expected a JSON object, got {type(doc).__name__}")
    unknown = sorted(set(doc) - _FIELDS)
    if unknown:
        raise CalibrationError(f"{path}: unknown field {unknown[0]!r}; allowed: {sorted(_FIELDS)}")
    missing = sorted(_FIELDS - _OPTIONAL - set(doc))
    if missing:
        raise CalibrationError(f"{path}: missing field {missing[0]!r}")
    if doc["format"] != FORMAT:
        raise CalibrationError(
            f"{path}: field 'format' = {shown(doc['format'])}; must be {FORMAT!r}"
        )
    version = doc["version"]
    if isinstance(version, bool) or version not in READ_VERSIONS:
        raise CalibrationError(
            f"{path}: field 'version' = {shown(version)}; this etjax reads versions "
            f"{', '.join(map(str, READ_VERSIONS))}"
        )
    if not isinstance(doc["model"], str):
        raise CalibrationError(f"{path}: field 'model' = {shown(doc['model'])}; must be a string")
    size = doc["vocab_size"]
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise CalibrationError(
            f"{path}: field 'vocab_size' = {shown(size)}; must be a positive integer"
        )
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
            f"{path}: field 'fit' = {shown(fit)}; must be an object of numbers and strings"
        )
    recorded = _recorded_identity(path, doc, version)
    if identity is not None:
        _check_identity(path, doc["model"], recorded, identity, model_name)
    return Calibration(float(doc["temperature"]), doc["model"], size, fit, float(shift), recorded)


def _recorded_identity(path: Path, doc: dict, version: int) -> dict[str, str | int] | None:
    # Version 2 records the model's identity; version 1 could not.
    value = doc.get("model_identity")
    if value is None and version >= 2:
        raise CalibrationError(
            f"{path}: missing field 'model_identity' (version {version} files record the "
            "model they were fitted for)"
        )
    if value is not None and (
        not isinstance(value, dict)
        or not value
        or not all(isinstance(v, str | int) and not isinstance(v, bool) for v in value.values())
    ):
        raise CalibrationError(
            f"{path}: field 'model_identity' = {shown(value)}; must be an object of strings "
            "and integers (what `etjax calibrate` writes)"
        )
    return value


def _check_identity(
    path: Path,
    fitted_name: str,
    recorded: dict[str, str | int] | None,
    identity: dict[str, str | int],
    model_name: str | None,
) -> None:
    # Refuse a file fitted for another model; an old file, with nothing to compare, is
    # accepted with a warning.
    loaded = f"the model loaded ({model_name!r})" if model_name else "the model loaded"
    if recorded is None:
        log.warning(
            "%s: a version 1 calibration file, which does not record the model it was fitted "
            "for: checked against %s by its vocabulary alone. Fit it again with `etjax "
            "calibrate` to have the model checked",
            path,
            loaded,
        )
        return
    differ = [
        k for k in sorted(set(recorded) | set(identity)) if recorded.get(k) != identity.get(k)
    ]
    if differ:
        what = "; ".join(f"{k} {recorded.get(k)!r} vs {identity.get(k)!r}" for k in differ)
        raise CalibrationError(
            f"{path}: fitted for another model: the file's model ({fitted_name!r}) and {loaded} "
            f"differ in {what} (the file's value first). A calibration holds only for the "
            "weights it was fitted on: fit one for this model with `etjax calibrate`"
        )


def _check_temperature(value: Any, where: str) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not MIN_TEMPERATURE <= value <= MAX_TEMPERATURE:
        raise CalibrationError(
            f"{where} = {shown(value)}; must be a number in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}]"
        )


def _check_ramp_shift(value: Any, where: str) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or abs(value) > MAX_RAMP_SHIFT:
        raise CalibrationError(
            f"{where} = {shown(value)}; must be a number of nats in "
            f"[{-MAX_RAMP_SHIFT}, {MAX_RAMP_SHIFT}]"
        )
