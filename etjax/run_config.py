"""Named run configurations: declarative TOML files in `configs/`, loaded into the frozen
dataclasses that steer a run.

A file has up to seven tables, each optional:

    [model]    name (a model name or path), dtype ("auto" | "float32" | "bfloat16"), weights
               ("auto" | "stored" | "stored-int8-rows" | "int8" | "float32" | "bfloat16":
               etjax/model/quantized.py)
    [engine]   any `RuntimeOptions` field except pruning, speculation and experts (page_size,
               max_batch_size, policy, ...)
    [pruning]  any `PruningConfig` field (enabled, min_fraction, entropy_low, ...)
    [speculation]  any `SpeculationConfig` field (enabled, max_draft, entropy_max, ...)
    [experts]  any `ExpertConfig` field (enabled, entropy_threshold, reduced_top_k): entropy-
               steered experts on a mixture-of-experts model (etjax/experts)
    [sampler]  any `SamplerSettings` field: the default for requests that do not set it
    [request]  any request field open to configs (etjax/request_fields.py: max_new_tokens,
               stop, chat, ...): the default for requests that do not set it

A model preset (`configs/models/NAME.toml`) holds only [model] and [engine]: it says which
weights to run and, where a model needs them, engine sizes. `load_run_config(config,
model=preset)` puts the preset's model in place of the config's and lets its [engine] keys
win, so one ablation config runs unchanged on any model.

An unknown table or key, or a value the dataclass refuses, is a `ConfigError` naming the
file, the table, the key and what is allowed.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from etjax.drafting.config import SpeculationConfig
from etjax.errors import ConfigError, EtjaxError, FieldError, shown
from etjax.experts.config import ExpertConfig
from etjax.model.config import DTYPE_CHOICES
from etjax.model.quantized import check_weights
from etjax.pruning.config import PruningConfig
from etjax.request_fields import RequestDefaults
from etjax.runtime.options import RuntimeOptions
from etjax.sampling.settings import SamplerSettings

# configs/ at the top of a clone; etjax/configs links to it, so the package finds it the same
# way in a clone and in a wheel (which holds the files themselves, as package data).
CONFIG_DIR = Path(str(importlib.resources.files("etjax") / "configs"))
MODEL_PRESET_DIR = CONFIG_DIR / "models"


@dataclass(frozen=True)
class ModelChoice:
    name: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    dtype: str = "auto"  # bfloat16 on a TPU or a GPU, float32 on a CPU
    # A file written by `etjax calibrate` (etjax/calibration): pruning, the scheduler and
    # drafting then read the calibrated entropy. In a .toml file a relative path is relative
    # to that file, so a preset and its calibration travel together.
    calibration: str | None = None
    # How the matrices are held (etjax/model/quantized.py): "auto" keeps float matrices in
    # `dtype`; "stored" a GGUF's blocks; "stored-int8-rows" the same blocks multiplied by rows
    # rounded to int8; "int8" per output channel; "float32" | "bfloat16".
    weights: str = "auto"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise FieldError("dtype", self.dtype, f"one of {DTYPE_CHOICES}")
        check_weights(self.weights)


@dataclass(frozen=True)
class RunConfig:
    """Everything a named configuration sets."""

    name: str
    model: ModelChoice = field(default_factory=ModelChoice)
    options: RuntimeOptions = field(default_factory=RuntimeOptions)
    sampler: SamplerSettings = field(default_factory=SamplerSettings)
    request: RequestDefaults = field(default_factory=RequestDefaults)


_TABLES = {
    "model": ModelChoice,
    "engine": RuntimeOptions,
    "pruning": PruningConfig,
    "speculation": SpeculationConfig,
    "experts": ExpertConfig,
    "sampler": SamplerSettings,
    "request": RequestDefaults,
}
_PRESET_TABLES = ("model", "engine")


def available_configs() -> list[str]:
    """Names of the configs shipped in `configs/`."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.toml"))


def available_model_presets() -> list[str]:
    """Names of the model presets shipped in `configs/models/`."""
    return sorted(p.stem for p in MODEL_PRESET_DIR.glob("*.toml"))


def is_model_preset(name_or_path: str | Path) -> bool:
    """Whether `name_or_path` names a shipped model preset or is a .toml file's path."""
    path = Path(name_or_path)
    return path.suffix == ".toml" or (MODEL_PRESET_DIR / f"{name_or_path}.toml").is_file()


def load_run_config(name_or_path: str | Path, model: str | Path | None = None) -> RunConfig:
    """Load `configs/NAME.toml`, or a TOML file by path; `model` names a model preset
    (`configs/models/NAME.toml`, or a .toml path) that replaces the config's model."""
    path = _find(name_or_path, CONFIG_DIR, "config", available_configs())
    data = _read(path, _TABLES)
    built = {name: _build(path, name, cls, data.get(name, {})) for name, cls in _TABLES.items()}
    if model is not None:
        preset_path = _find(model, MODEL_PRESET_DIR, "model preset", available_model_presets())
        preset = _read(preset_path, _PRESET_TABLES)
        # Each file is validated alone, so an error names the file it is in.
        _build(preset_path, "engine", RuntimeOptions, dict(preset.get("engine", {})))
        built["model"] = _build(preset_path, "model", ModelChoice, preset.get("model", {}))
        engine = {**data.get("engine", {}), **preset.get("engine", {})}
        built["engine"] = _build(preset_path, "engine", RuntimeOptions, engine)
    try:  # the engine checks how the tables combine (max_draft and steps_per_sync)
        options = dataclasses.replace(
            built["engine"],
            pruning=built["pruning"],
            speculation=built["speculation"],
            experts=built["experts"],
        )
    except FieldError as e:
        raise ConfigError(f"{path}: {e}") from None
    return RunConfig(
        name=path.stem,
        model=built["model"],
        options=options,
        sampler=built["sampler"],
        request=built["request"],
    )


def _find(name_or_path: str | Path, directory: Path, kind: str, available: list[str]) -> Path:
    path = Path(name_or_path)
    if path.suffix != ".toml":
        path = directory / f"{name_or_path}.toml"
    if not path.is_file():
        raise ConfigError(
            f"{kind} {str(name_or_path)!r} not found ({path}); available: "
            f"{', '.join(available)}, or the path of a .toml file"
        )
    return path


def _read(path: Path, tables) -> dict:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text, as TOML must be ({e})") from None
    except RecursionError:  # tomllib parses nested arrays and inline tables recursively
        raise ConfigError(
            f"{path}: arrays or inline tables nested too deeply to read (past Python's "
            "recursion limit); a run config holds flat tables of key = value"
        ) from None
    unknown = sorted(set(data) - set(tables))
    if unknown:
        raise ConfigError(f"{path}: unknown table [{unknown[0]}]; allowed: {sorted(tables)}")
    return data


# The field annotations of the config dataclasses, and what a TOML value must be for each.
_TYPES = {
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "int": ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "float": ("a number", lambda v: isinstance(v, int | float) and not isinstance(v, bool)),
    "str": ("a string", lambda v: isinstance(v, str)),
    "tuple[str, ...]": (
        "a list of strings",
        lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    ),
}


def _check_type(path: Path, table: str, key: str, value: object, annotation: str) -> None:
    # "int | None" and the like: TOML has no null, so the value must be the other type.
    name = annotation.removesuffix(" | None")
    if name not in _TYPES:
        return  # a type the dataclass checks itself
    allowed, ok = _TYPES[name]
    if not ok(value):
        raise ConfigError(f"{path}: [{table}] {key} = {shown(value)}; must be {allowed}")


def _build(path: Path, table: str, cls, values: object):
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: [{table}] must be a table of key = value pairs")
    allowed = {f.name for f in dataclasses.fields(cls)} - (
        {"pruning", "speculation", "experts"} if table == "engine" else set()
    )
    for key, value in values.items():
        if key not in allowed:
            raise ConfigError(f"{path}: [{table}] unknown key {key!r}; allowed: {sorted(allowed)}")
        expected = str({f.name: f.type for f in dataclasses.fields(cls)}[key])
        _check_type(path, table, key, value, expected)
        if "float" in expected and isinstance(value, int) and not isinstance(value, bool):
            values[key] = float(value)  # TOML writes 1 for 1.0
    if table == "model" and values.get("calibration") is not None:
        values["calibration"] = str(path.parent / Path(values["calibration"]).expanduser())
    try:
        return cls(**values)
    except (EtjaxError, TypeError) as e:
        raise ConfigError(f"{path}: [{table}] {e}") from None
