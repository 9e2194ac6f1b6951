"""Sections of a performance document (docs/PERF.md) that benchmarks rewrite in place.

Each section sits between `<!-- begin NAME -->` and `<!-- end NAME -->`; rewriting one leaves
the rest of the document, hand-written analysis included, as it is, except its contents: the
`contents` section lists the document's parts (`# ` titles) and sections (`## ` titles) again
after every rewrite, so a section a benchmark adds is listed too.
"""

from __future__ import annotations

import os
import platform
import re
from collections import Counter
from pathlib import Path

CONTENTS = "contents"

HEADER = (
    "# etjax performance\n\n"
    "Every figure here is written by the benchmark named in its section; rerun the command to\n"
    "regenerate it. Figures from one section were measured side by side in one run; compare\n"
    "ratios, not absolute times across sections (the machines are shared and noisy).\n\n"
    f"## Contents\n\n<!-- begin {CONTENTS} -->\n<!-- end {CONTENTS} -->\n"
)


def replace_section(document: Path, name: str, markdown: str) -> None:
    """Put `markdown` in section `name` of `document`, appending the section if it is new, and
    list the document's sections again in its contents."""
    begin, end = f"<!-- begin {name} -->", f"<!-- end {name} -->"
    text = document.read_text() if document.exists() else HEADER
    block = f"{begin}\n{markdown.rstrip()}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    text = with_contents(text)
    document.parent.mkdir(parents=True, exist_ok=True)
    document.write_text(text)


def with_contents(text: str) -> str:
    """`text` with its `contents` section listing, one line each and linked, the part (`# `) and
    section (`## `) titles that follow it; `text` itself where it has no contents section."""
    begin, end = f"<!-- begin {CONTENTS} -->", f"<!-- end {CONTENTS} -->"
    if begin not in text or end not in text:
        return text
    head, rest = text.split(begin, 1)
    tail = rest.split(end, 1)[1]
    # Anchors count every heading of the page, as GitHub numbers repeated ones.
    seen: Counter[str] = Counter()
    for _, title in _headings(head):
        seen[anchor(title)] += 1
    entries = []
    for level, title in _headings(tail):
        slug = anchor(title)
        link = f"{slug}-{seen[slug]}" if seen[slug] else slug
        seen[slug] += 1
        if level <= 2:
            entries.append((level, f"[{title}](#{link})"))
    # Sections sit under their part where the document has parts, at the top where not.
    top = min((level for level, _ in entries), default=1)
    lines = [f"{'  ' * (level - top)}- {link}" for level, link in entries]
    return head + begin + "\n" + "".join(f"{line}\n" for line in lines) + end + tail


def anchor(title: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def _headings(markdown: str) -> list[tuple[int, str]]:
    """(level, title) of each ATX heading outside fenced code, in order."""
    headings, fenced = [], False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (found := re.match(r"(#{1,6}) +(.*?)\s*$", line)):
            headings.append((len(found.group(1)), found.group(2)))
    return headings


def cpu_name(machine: str) -> str:
    """The CPU model and its vector extensions from a `machine_line()`, for a title."""
    return machine.split("), ", 1)[0] + ")" if "), " in machine else machine


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
