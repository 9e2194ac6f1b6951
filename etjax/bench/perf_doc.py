"""Sections of a performance document (docs/PERF.md) that benchmarks rewrite in place.

Each section sits between `<!-- begin NAME -->` and `<!-- end NAME -->`; rewriting one leaves
the rest of the document, hand-written analysis included, as it is.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

HEADER = (
    "# etjax performance\n\n"
    "Every figure here is written by the benchmark named in its section; rerun the command to\n"
    "regenerate it. Figures from one section were measured side by side in one run; compare\n"
    "ratios, not absolute times across sections (the machines are shared and noisy).\n"
)


def replace_section(document: Path, name: str, markdown: str) -> None:
    """Put `markdown` in section `name` of `document`, appending the section if it is new."""
    begin, end = f"<!-- begin {name} -->", f"<!-- end {name} -->"
    text = document.read_text() if document.exists() else HEADER
    block = f"{begin}\n{markdown.rstrip()}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    document.parent.mkdir(parents=True, exist_ok=True)
    document.write_text(text)


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
    import jax

    return (
        f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"JAX {jax.__version__} ({jax.default_backend()})"
    )
