"""A workload of one's own for `etjax bench --workload FILE.jsonl`.

One JSON object per line, in the batch job's record format as far as a comparison of configs
allows: `id` (optional), `prompt` (a string) or `messages` (a chat conversation, rendered by
the model's chat template), `max_new_tokens` (default 128), `priority` (default 0) and
`arrival`, the request's arrival in seconds after the run starts (default 0: at once). Each
config's sampler applies to every request, since the sampler is one of the things a
comparison varies, so a record's sampler fields are refused by name rather than ignored.
A bad line stops the benchmark before anything runs, with the file, the line and the field:
a benchmark over part of a workload would measure something else.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from etjax.bench.workloads import WorkloadRequest
from etjax.errors import ConfigError, shown
from etjax.request_checks import tokenize_prompt

FIELDS = ("id", "prompt", "messages", "max_new_tokens", "priority", "arrival")
DEFAULT_NEW_TOKENS = 128


def is_workload_file(name: str) -> bool:
    """Whether `--workload` names a file rather than a built-in workload."""
    return name.endswith(".jsonl")


def workload_label(name: str) -> str:
    """The name results and PERF.md sections are filed under: a file's stem, else the name."""
    return Path(name).stem if is_workload_file(name) else name


def run_label(
    workload: str, equal_length: bool = False, load: float | None = None, arrivals: bool = False
) -> str:
    """What one run is filed under (its results folder and PERF.md section `ablation_LABEL`):
    the workload's label, `_load0.8` for an online run (`online`, or `arrivals`) at that load
    (runs at several loads sit side by side) and `_equal` for an `--equal-length` one."""
    label = workload_label(workload)
    if (workload == "online" or arrivals) and load is not None:
        label += f"_load{load:g}"
    return label + ("_equal" if equal_length else "")


def read_workload_file(path: str | Path, model) -> list[WorkloadRequest]:
    """The requests of a workload file, checked and tokenized for `model`."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ConfigError(f"workload file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"workload file {path}: not UTF-8 text ({e})") from None
    requests = []
    for number, text in enumerate(lines, start=1):
        if text.strip():
            requests.append(_request(text, f"{path}, line {number}", model, len(requests)))
    if not requests:
        raise ConfigError(f"workload file {path}: no records")
    return requests


def _request(text: str, where: str, model, index: int) -> WorkloadRequest:
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: not valid JSON ({e.msg})") from None
    except RecursionError:
        raise ConfigError(f"{where}: JSON nested too deeply to read") from None
    if not isinstance(record, dict):
        raise ConfigError(f"{where}: a record must be a JSON object")
    unknown = sorted(set(record) - set(FIELDS))
    if unknown:
        raise ConfigError(
            f"{where}: field {unknown[0]!r} is not read by a benchmark (each config's sampler "
            f"applies); allowed: {', '.join(FIELDS)}"
        )
    if ("prompt" in record) == ("messages" in record):
        raise ConfigError(f'{where}: give "prompt" (a string) or "messages" (a list), one')
    new = _number(record, "max_new_tokens", DEFAULT_NEW_TOKENS, where, integer=True)
    if new < 1:
        raise ConfigError(f"{where}: max_new_tokens={new}; must be at least 1")
    priority = _number(record, "priority", 0.0, where)
    arrival = _number(record, "arrival", 0.0, where)
    if arrival < 0:
        raise ConfigError(f"{where}: arrival={arrival}; must be >= 0 seconds")
    prompt = record.get("prompt", record.get("messages"))
    ids, error = tokenize_prompt(model, prompt, index, False, None, new)
    if error is not None:
        raise ConfigError(f"{where}: {error}")
    kind = "chat" if "messages" in record else "prompt"
    text_prompt = prompt if isinstance(prompt, str) else model.tokenizer.decode(ids)
    return WorkloadRequest(kind, text_prompt, new, tuple(ids), priority, arrival)


def _number(record: dict, name: str, default: float, where: str, integer: bool = False):
    value = record.get(name, default)
    # JSON's NaN and Infinity parse as floats; no arrival or priority can be one.
    ok = isinstance(value, int) if integer else isinstance(value, int | float)
    if isinstance(value, bool) or not ok or not math.isfinite(value):
        kind = "an integer" if integer else "a finite number"
        raise ConfigError(f"{where}: {name}={shown(value)}; must be {kind}")
    return value
