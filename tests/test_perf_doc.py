"""docs/PERF.md's sections and contents, as benchmarks rewrite them (etjax/bench/perf_doc.py)."""

import re
from pathlib import Path

from etjax.bench.perf_doc import HEADER, cpu_name, replace_section, with_contents

PERF_MD = Path(__file__).resolve().parent.parent / "docs" / "PERF.md"


def _contents(text: str) -> str:
    return text.split("<!-- begin contents -->\n", 1)[1].split("<!-- end contents -->", 1)[0]


def test_a_new_section_is_listed_in_the_contents_with_its_anchor(tmp_path):
    document = tmp_path / "PERF.md"
    replace_section(document, "one", "## Decode: etjax vs `transformers` (batch 8, 1.5x)\n\nA.")
    document.write_text(document.read_text() + "\n### A reading by hand\n\nKept.\n")
    replace_section(document, "two", "## Load-time memory\n\nB.")
    text = document.read_text()
    # GitHub's anchors: lower case, punctuation dropped, each space a hyphen.
    assert _contents(text) == (
        "- [Decode: etjax vs `transformers` (batch 8, 1.5x)]"
        "(#decode-etjax-vs-transformers-batch-8-15x)\n"
        "- [Load-time memory](#load-time-memory)\n"
    )
    assert "### A reading by hand\n\nKept." in text


def test_a_rewritten_title_replaces_its_line_and_leaves_the_text_around_it(tmp_path):
    document = tmp_path / "PERF.md"
    replace_section(document, "one", "## Old title\n\nA.")
    document.write_text(document.read_text() + "\nA reading by hand.\n")
    replace_section(document, "one", "## New title\n\nA again.")
    text = document.read_text()
    assert _contents(text) == "- [New title](#new-title)\n"
    assert "Old title" not in text
    assert text.endswith("A again.\n<!-- end one -->\n\nA reading by hand.\n")


def test_parts_nest_their_sections_and_repeated_titles_are_numbered():
    text = with_contents(
        HEADER + "\n# Part one\n\n## Same\n\n### Reading\n\n# Part two\n\n## Same\n\n### Reading\n"
    )
    assert _contents(text) == (
        "- [Part one](#part-one)\n  - [Same](#same)\n- [Part two](#part-two)\n  - [Same](#same-1)\n"
    )


def test_a_document_without_contents_is_left_as_it_is():
    text = "# Title\n\n## Section\n"
    assert with_contents(text) == text


def test_cpu_name_is_the_model_and_its_vector_extensions():
    line = "Intel(R) Xeon(R) Processor (AVX2, AVX-512, AMX), 2 cores, Python 3.11.7, JAX 0.10.2"
    assert cpu_name(line) == "Intel(R) Xeon(R) Processor (AVX2, AVX-512, AMX)"
    assert cpu_name("AMD EPYC (AVX2), 2 cores, Python 3.11.7") == "AMD EPYC (AVX2)"


def test_the_performance_document_has_whole_sections_unique_titles_and_current_contents():
    text = PERF_MD.read_text()
    markers = re.findall(r"^<!-- (begin|end) (\S+) -->$", text, re.M)
    opened = None
    for kind, name in markers:
        # A section inside another would be wiped when the outer one's benchmark reruns.
        assert (kind, opened) in (("begin", None), ("end", name)), f"{kind} {name} in {opened}"
        opened = name if kind == "begin" else None
    titles = re.findall(r"^## (.*)$", text, re.M)
    assert len(titles) == len(set(titles)), "two sections share a title"
    assert with_contents(text) == text, "contents are stale: run etjax.bench.perf_doc.with_contents"
