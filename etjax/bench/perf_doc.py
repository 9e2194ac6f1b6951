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
    """Where the numbers come from: CPU model, the vector extensions that matter to XLA:CPU's
    matrix products (AVX-512, AMX), core count, JAX version and backend."""
    cpu, flags = platform.processor() or platform.machine(), set()
    try:
        fields = dict(
            line.split(":", 1)
            for line in Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
            if ":" in line
        )
        fields = {key.strip(): value.strip() for key, value in fields.items()}
        cpu = fields.get("model name", cpu)
        flags = set(fields.get("flags", "").split())
    except OSError:
        pass
    extensions = [
        name
        for name, flag in (("AVX2", "avx2"), ("AVX-512", "avx512f"), ("AMX", "amx_tile"))
        if flag in flags
    ]
    import jax

    return (
        f"{cpu} ({', '.join(extensions) or 'no AVX2'}), {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, JAX {jax.__version__} ({jax.default_backend()})"
    )
