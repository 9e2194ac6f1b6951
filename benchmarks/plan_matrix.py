"""`etjax plan` for every planned model on every one-host topology: how long each answers,
compile included, and what it says.

Each combination runs as a user runs it, `etjax plan CONFIG --topology T --json` in a process
of its own (its programs compiled by the TPU compiler in children of their own), with the
default config's engine (batch 32) at 4K context, bfloat16. Per combination: the command's
wall seconds, the CPU seconds of it and its children, each program's own compile CPU seconds,
whether the model fits, the modelled decode tokens/s and the compiler's errors.

Wall seconds depend on what else the host runs; CPU seconds do not. The two programs compile
side by side (two children, one core each on a 2-core host), so on an otherwise idle host the
command's wall time is about its CPU seconds less the shorter compile's: the "quiet estimate"
column. Run it on an idle host to read the wall column as the target's measure.

    .venv/bin/python benchmarks/plan_matrix.py [--models llama-3.1-8b,...] [--topologies v5e-1,...]
    .venv/bin/python benchmarks/plan_matrix.py --from-log RUN.log   # write a saved run's rows

Writes the "plan_matrix" section of docs/TPU.md and benchmarks/results/plan_matrix.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODELS = (
    "llama-3.1-8b", "qwen3-8b", "gemma-3-12b", "qwen3-30b-a3b", "mixtral-8x7b", "llama-3.1-70b",
)  # fmt: skip
TOPOLOGIES = ("v5e-1", "v5e-8", "v6e-1", "v6e-8")
PLANS = ROOT / "etjax" / "configs" / "models" / "plan"
TARGET_S = 180  # issue 62: every combination answers in at most 3 minutes


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def plan_once(model: str, topology: str, context: int) -> dict:
    """One `etjax plan` command, timed; its JSON with the timings beside it."""
    command = [
        str(Path(sys.executable).parent / "etjax"), "plan", str(PLANS / f"{model}.json"),
        "--topology", topology, "--context", str(context), "--json",
    ]  # fmt: skip
    cpu, start = children_cpu(), time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    wall, cpu = time.perf_counter() - start, children_cpu() - cpu
    row = {"model": model, "topology": topology, "exit": done.returncode, "wall_s": wall}
    row["cpu_s"] = cpu
    if done.returncode not in (0, 1):
        row["error"] = done.stderr.strip().splitlines()[-1:] or ["no message"]
        return row
    answer = json.loads(done.stdout)
    compiles = [p.get("compile_cpu_s", 0.0) for p in answer["programs"]]
    row |= {
        "fits": answer["fits"],
        "weights_gib_per_chip": answer["weights_bytes_per_chip"] / 2**30,
        "max_batch_at_context": answer["max_batch_at_context"],
        "tokens_per_s": answer["modelled_decode_tokens_per_s"],
        "programs": [p["name"] for p in answer["programs"]],
        "compile_cpu_s": compiles,
        # The two compiles overlap on two cores; the rest (imports, children starting, the
        # plan's own work) runs one thing at a time.
        "quiet_estimate_s": cpu - (min(compiles) if len(compiles) == 2 else 0.0),
        "errors": answer["errors"],
    }
    return row


def table(rows: list[dict], context: int) -> str:
    from benchmarks.perf_report import machine_line

    lines = [
        f"`benchmarks/plan_matrix.py`, {datetime.date.today()}, {machine_line()}; "
        f"`etjax plan CONFIG --topology T --context {context} --json`, the default config "
        "(batch 32), bfloat16, programs at 2 layers. Wall: the command as run (what else the "
        "host ran shows in it); CPU: it and its children; quiet estimate: CPU less the "
        "shorter of the two overlapping compiles.",
        "",
        "| model | topology | fits | largest batch at "
        f"{context} | modelled tokens/s at batch 32, all chips (fits or not) "
        "| programs compiled (CPU s each) | wall s | CPU s "
        "| quiet estimate s | errors |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r['model']} | {r['topology']} | failed (exit {r['exit']}) | | | | "
                f"{r['wall_s']:.0f} | {r['cpu_s']:.0f} | | {r['error'][0][:80]} |"
            )
            continue
        compiled = ", ".join(
            f"{n} {c:.0f}" for n, c in zip(r["programs"], r["compile_cpu_s"], strict=True)
        )
        errors = "; ".join(e[:80] for e in r["errors"]) or "–"
        lines.append(
            f"| {r['model']} | {r['topology']} | {'yes' if r['fits'] else 'no'} | "
            f"{r['max_batch_at_context']} | {r['tokens_per_s']:,.0f} | {compiled or 'none'} | "
            f"{r['wall_s']:.0f} | {r['cpu_s']:.0f} | {r['quiet_estimate_s']:.0f} | {errors} |"
        )
    worst = max(rows, key=lambda r: r["wall_s"])
    estimates = [r["quiet_estimate_s"] for r in rows if "quiet_estimate_s" in r]
    lines += [
        "",
        f"Longest wall: {worst['wall_s']:.0f} s ({worst['model']} on {worst['topology']}); "
        f"longest quiet estimate: {max(estimates, default=0):.0f} s; target: at most "
        f"{TARGET_S} s each.",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--topologies", default=",".join(TOPOLOGIES))
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--no-write", action="store_true", help="print, write nothing")
    parser.add_argument(
        "--from-log", default=None, help="the rows of an earlier run's output: write them"
    )
    args = parser.parse_args()
    rows = []
    if args.from_log:  # a run's printed rows (one JSON object a line), written as they are
        lines = Path(args.from_log).read_text().splitlines()
        rows = [json.loads(line) for line in lines if line.startswith("{")]
    for model in [] if args.from_log else args.models.split(","):
        for topology in args.topologies.split(","):
            rows.append(plan_once(model, topology, args.context))
            print(json.dumps(rows[-1]), flush=True)
    markdown = table(rows, args.context)
    print(markdown)
    if not args.no_write:
        from benchmarks.perf_report import write_section

        write_section("plan_matrix", markdown, {"rows": rows}, ROOT / "docs" / "TPU.md")


if __name__ == "__main__":
    main()
