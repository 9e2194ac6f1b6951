"""examples/quickstart.ipynb runs end to end, as a Colab user would run it.

The notebook's Python cells run in order in one namespace (what a kernel does), without
Jupyter: its shell lines (`!pip ...`), which install what this environment already has, are
left out. What it shows is then checked against independent facts: the schema validates the
constrained answer, the plot has a panel per trace field, every trace has a value per token.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import matplotlib

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "quickstart.ipynb"


def python_of(cell: dict) -> str:
    """A code cell's source without IPython's shell and magic lines."""
    lines = "".join(cell["source"]).splitlines()
    return "\n".join(line for line in lines if not line.lstrip().startswith(("!", "%")))


def test_quickstart_notebook_runs_and_shows_what_it_says():
    matplotlib.use("Agg")
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    namespace: dict = {}
    for index, cell in enumerate(cells):
        if cell["cell_type"] == "code":
            exec(compile(python_of(cell), f"{NOTEBOOK.name}[{index}]", "exec"), namespace)

    results = namespace["results"]
    assert [r.error for r in results] == [None, None]
    for r in results:
        assert 0 < len(r.token_ids) <= 24
        assert len(r.entropy) == len(r.token_ids)
        assert all(h >= 0.0 for h in r.entropy)
    # One panel per default trace field, each with one line per result.
    axes = namespace["figure"].axes
    assert axes and all(len(ax.get_lines()) == 2 for ax in axes)

    answer = namespace["answer"]
    assert answer.error is None
    if answer.finish_reason == "eos":  # "eos" under a schema means the output validates
        jsonschema.validate(json.loads(answer.text), namespace["schema"])
    else:
        assert answer.finish_reason == "length"
