"""Where `etjax bench` writes: `DIR/WORKLOAD/results.json` (raw figures), `table.md` and the PNG
plots, and optionally a section of a performance document (docs/PERF.md) that shows them."""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

from etjax.bench.perf_doc import machine_line, replace_section
from etjax.bench.plots import sample_requests, write_plots
from etjax.bench.report import markdown
from etjax.bench.workload_file import run_label, workload_label

# Per-request fields too bulky for results.json, except for the requests the plots show.
_BULKY = ("token_ids", "traces")


def write_outputs(
    raw: dict, directory: Path, command: str, perf_md: Path | None = None
) -> dict[str, Path]:
    """Write the results of `run_ablation` into `directory`; the paths written by kind. An
    equal-length run and an online run's load are filed apart (`run_label`)."""
    plan = raw["plan"]
    workload = workload_label(plan["workload"])
    section = "ablation_" + run_label(
        plan["workload"], plan.get("equal_length"), plan.get("load"), plan.get("arrivals", False)
    )
    directory.mkdir(parents=True, exist_ok=True)
    raw = {**raw, "machine": machine_line(), "date": str(datetime.date.today()), "command": command}
    plots = write_plots(raw, directory)
    table = _document(raw, workload, command)
    paths = {"json": directory / "results.json", "table": directory / "table.md"}
    paths["json"].write_text(json.dumps(_compact(raw), indent=1) + "\n")
    paths["table"].write_text(table + "\n")
    if perf_md is not None:
        replace_section(perf_md, section, table + "\n\n" + _plot_links(plots, directory, perf_md))
    return paths | {p.stem: p for p in plots}


def _plot_links(plots: list[Path], directory: Path, perf_md: Path) -> str:
    # Images the document can show: plots written under its own folder (`--output docs/bench`
    # beside docs/PERF.md). Elsewhere (a scratch directory) a link would break once the
    # directory is gone or the document is read in another clone, so it names the folder.
    relative = [Path(os.path.relpath(p.resolve(), perf_md.resolve().parent)) for p in plots]
    if any(r.parts[:1] == ("..",) for r in relative):
        return f"Plots: {directory} (not linked: outside the document's folder)."
    return "\n".join(f"![{p.stem}]({r.as_posix()})" for p, r in zip(plots, relative, strict=True))


def _quality_line(plan: dict) -> str:
    if not plan.get("quality", True):
        return "Quality: not measured in this run (`--no-quality`). "
    return (
        "Quality: greedy outputs against the first config's greedy outputs (ROUGE-L, "
        f"BLEU); perplexity ratio of {plan['ppl_docs']} documents of {plan['ppl_length']} "
        f"tokens; passkey at {', '.join(map(str, plan['passkey_lengths']))} tokens. "
    )


def _document(raw: dict, workload: str, command: str) -> str:
    plan = raw["plan"]
    poisson = workload == "online" or plan.get("arrivals", False)
    kinds: dict[str, int] = {}
    for request in raw["workload"]:
        kinds[request["kind"]] = kinds.get(request["kind"], 0) + 1
    arrivals = (
        "all submitted at once"
        if not poisson and not any(map(any, raw["arrivals"]))
        else "arriving at the times the workload file gives"
        if not poisson
        else f"Poisson arrivals at {plan['load']:.0%} of the capacity a warm baseline run "
        f"measured ({raw['capacity_requests_per_s']:.2f} requests/s), drawn anew for each "
        "repetition"
    )
    if plan.get("equal_length"):
        arrivals += (
            "; every request generated exactly its max_new_tokens (`--equal-length`: no EOS), "
            "so every config did the same work"
        )
    same = ", ".join(f"{a} = {b}" for a, b in raw["same_tokens_as"].items()) or "none"
    cold = "; ".join(
        f"{name}: {w['programs_compiled']} programs in {w['compile_s']:.1f} s"
        for name, w in raw.get("warm_up", {}).items()
    )
    return "\n".join(
        [
            f"## Ablation on the `{workload}` workload"
            + (f" at load {plan['load']:g}" if poisson else "")
            + (", equal length" if plan.get("equal_length") else "")
            + f" ({raw['model']})",
            "",
            f"Measured {raw['date']} on {raw['machine']}. Command: `{command}`. "
            f"{len(raw['workload'])} requests "
            f"({', '.join(f'{v} {k}' for k, v in sorted(kinds.items()))}), {arrivals}; "
            f"{plan['repetitions']} repetitions interleaved after a warm-up, median (min-max). "
            + _quality_line(plan)
            + f"Configs that reproduced an earlier config's sampled tokens exactly: {same}."
            + (
                f" Compiled by the cold (warm-up) run of each engine setting: {cold}."
                if cold
                else ""
            ),
            "",
            markdown(raw),
        ]
    )


def _compact(raw: dict) -> dict:
    keep = set(sample_requests(raw, 3))
    runs = {
        name: [
            {
                **run,
                "requests": [
                    r if i in keep else {k: v for k, v in r.items() if k not in _BULKY}
                    for i, r in enumerate(run["requests"])
                ],
            }
            for run in reps
        ]
        for name, reps in raw["runs"].items()
    }
    return {**raw, "runs": runs}
