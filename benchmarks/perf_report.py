"""Write one benchmark's section of docs/PERF.md, leaving the other sections as they are."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from etjax.bench.perf_doc import machine_line, replace_section

__all__ = ["machine_line", "median_spread", "write_section"]

ROOT = Path(__file__).resolve().parent.parent
PERF_MD = ROOT / "docs" / "PERF.md"
RESULTS = ROOT / "benchmarks" / "results"


def median_spread(values: list[float]) -> str:
    """'median (min-max)' with 3 significant digits."""
    return f"{statistics.median(values):.3g} ({min(values):.3g}-{max(values):.3g})"


def write_section(name: str, markdown: str, raw: dict, document: Path = PERF_MD) -> None:
    """Replace section `name` of `document` (docs/PERF.md) and save `raw` as results/NAME.json."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(raw, indent=2) + "\n")
    replace_section(document, name, markdown)
