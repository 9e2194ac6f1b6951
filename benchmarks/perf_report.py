"""Write one benchmark's section of docs/PERF.md, leaving the other sections as they are."""

from __future__ import annotations

import json
import platform
import statistics
from pathlib import Path

import jax

ROOT = Path(__file__).resolve().parent.parent
PERF_MD = ROOT / "docs" / "PERF.md"
RESULTS = ROOT / "benchmarks" / "results"
_HEADER = (
    "# etjax performance\n\n"
    "Every figure here is written by the benchmark named in its section; rerun the command to\n"
    "regenerate it. Figures from one section were measured side by side in one run; compare\n"
    "ratios, not absolute times across sections (the machines are shared and noisy).\n"
)


def machine_line() -> str:
    """Where the numbers come from: CPU model, core count, JAX version and backend."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import os

    return (
        f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"JAX {jax.__version__} ({jax.default_backend()})"
    )


def median_spread(values: list[float]) -> str:
    """'median (min-max)' with 3 significant digits."""
    return f"{statistics.median(values):.3g} ({min(values):.3g}-{max(values):.3g})"


def write_section(name: str, markdown: str, raw: dict, document: Path = PERF_MD) -> None:
    """Replace section `name` of `document` (docs/PERF.md) and save `raw` as results/NAME.json."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(raw, indent=2) + "\n")
    begin, end = f"<!-- begin {name} -->", f"<!-- end {name} -->"
    text = document.read_text() if document.exists() else _HEADER
    block = f"{begin}\n{markdown.rstrip()}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    document.parent.mkdir(parents=True, exist_ok=True)
    document.write_text(text)
