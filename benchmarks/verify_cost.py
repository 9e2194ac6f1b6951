"""What a verifying ragged step costs against a step of a decode burst (SmolLM2, this CPU).

The cost gate on drafting (etjax/drafting/rule.py, `verification_pays`) compares the two; this
measures them. For each batch size, the engine (speculative_only: dense, fcfs) prefills that
many prompts of the mixed workload, then times, interleaved and repeated after two warm-up
calls of each (so no compilation is timed):

- a burst of `steps_per_sync` decode steps, divided by the steps (one burst step);
- one ragged step of the same rows with no drafts;
- the same with one row drafting 1 token, and with one row drafting `max_draft` tokens (the
  row's own last tokens: mostly rejected, so the verification checks few positions).

Reports medians and spreads, the paired median ratio of each to the burst step, and the
ratio the gate's cost model predicts with the default constants. Writes the "verify_cost"
section of docs/PERF.md.

`--workload long --config full`: the rows are the `long` workload's requests instead (4K-16K
token documents, four requests on each), under the full loop's pruning: the cost the gate
meets at long context (section "verify_cost_long").

    .venv/bin/python benchmarks/verify_cost.py [--rows 1,4,15] [--repeats 5]
    .venv/bin/python benchmarks/verify_cost.py --workload long --config full --rows 4,8
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import shlex
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.perf_report import machine_line, write_section
from etjax.bench.measure import request_settings
from etjax.bench.workloads import long, mixed
from etjax.drafting import DraftHistory, SpeculationConfig
from etjax.drafting.rule import burst_step_cost, verify_step_cost
from etjax.engine.sequence import Status
from etjax.engine_build import build_engine, workload_pages
from etjax.run_config import load_run_config

KINDS = ("burst step", "ragged, no draft", "ragged, 1 draft", "ragged, max_draft drafts")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,15", help="batch sizes, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workload", choices=("short", "long"), default="short")
    parser.add_argument("--config", default="speculative_only", help="a config with speculation")
    args = parser.parse_args()
    import etjax
    from etjax.bench.corpus import lee_articles

    rows_asked = list(map(int, args.rows.split(",")))
    model = etjax.load_model(load_run_config(args.config).model.name)
    if args.workload == "long":  # the documents fit the model's context, as in `etjax bench`
        context = model.config.max_position_embeddings
        requests = long(model.tokenizer, lee_articles(), max(rows_asked), 0, context)
    else:
        requests = [r for r in mixed(model.tokenizer, lee_articles(), 64, seed=0)
                    if r.kind != "long"]  # fmt: skip
    results = {}
    for rows in rows_asked:
        results[rows] = _time_steps(model, requests[:rows], args.repeats, args.config)
        print(rows, {k: float(np.median(v)) for k, v in results[rows]["seconds"].items()})
    _report(results, args)


def _time_steps(model, workload, repeats: int, config_name: str) -> dict:
    config = load_run_config(config_name)
    options = config.options
    # Long outputs and no eos: the rows stay resident through every timed call.
    workload = [dataclasses.replace(r, max_new_tokens=2000) for r in workload]
    settings = [
        dataclasses.replace(s, ignore_eos=True) for s in request_settings(config, workload, False)
    ]
    prompts = [model.tokenizer.encode(r.prompt) for r in workload]
    pages = workload_pages(prompts, settings, options)
    engine = build_engine(model.weights, model.config, model.tokenizer, options, pages)
    for prompt, s in zip(prompts, settings, strict=True):
        engine.submit(prompt, s)
    engine._drafts = lambda batch, budget: [[] for _ in batch]  # prefill without drafting
    while any(s.status is not Status.RUNNING for s in engine.live):
        engine.step()
    batch = sorted(engine.live, key=lambda s: s.row)
    for seq in batch:
        seq.drafts = DraftHistory(options.speculation.acceptance_prior)
    max_draft = options.speculation.max_draft

    def burst() -> float:
        engine._reserve_burst_pages(batch, batch)
        return engine._decode_burst(batch) / options.steps_per_sync

    def ragged(drafted: int) -> float:
        engine._reserve_burst_pages(batch, batch)
        drafts = [[] for _ in batch]
        if drafted:
            drafts[0] = [int(t) for t in batch[0].output.token_ids[-drafted:]]
        return engine._mixed(batch, [], drafts)

    calls = dict(
        zip(
            KINDS,
            (burst, lambda: ragged(0), lambda: ragged(1), lambda: ragged(max_draft)),
            strict=True,
        )
    )
    for call in calls.values():  # warm-up: compiles
        call(), call()
    seconds = {kind: [] for kind in KINDS}
    for _ in range(repeats):
        for kind, call in calls.items():
            seconds[kind].append(call())
    return {"lengths": [s.length for s in batch], "seconds": seconds}


def _predicted(rows: int, drafted: int, cfg: SpeculationConfig) -> float:
    # The gate's model of a verifying step over one burst step.
    return verify_step_cost(rows, drafted, cfg) / burst_step_cost(rows, cfg)


def _report(results: dict, args) -> None:
    cfg = SpeculationConfig(enabled=True)
    drafted = dict(zip(KINDS, (None, 0, 1, cfg.max_draft), strict=True))
    rows_of = (
        "the `long` workload's requests (four on each 4K-16K-token document)"
        if args.workload == "long"
        else "the mixed workload's short prompts"
    )
    lines = [
        f"## What a verifying step costs against a burst step (SmolLM2, {args.config}"
        + (", long context)" if args.workload == "long" else ")"),
        "",
        f"Measured {datetime.date.today()} on {machine_line()}. Command: `.venv/bin/python "
        f"benchmarks/verify_cost.py {shlex.join(sys.argv[1:])}`. Rows of {rows_of}, "
        f"prefilled; then {args.repeats} interleaved repetitions of each call "
        "after two warm-up calls. Ratios are paired medians against the burst step of the "
        'same repetition; "model" is what the drafting gate\'s cost model '
        f"(pass_fixed_tokens {cfg.pass_fixed_tokens}, verify_row_tokens "
        f"{cfg.verify_row_tokens}) predicts.",
        "",
        "| rows | call | median ms | spread ms | vs burst step | model |",
        "|---|---|---|---|---|---|",
    ]
    for rows, r in results.items():
        base = np.asarray(r["seconds"]["burst step"])
        for kind, seconds in r["seconds"].items():
            seconds = np.asarray(seconds)
            model = "" if not drafted[kind] else f"{_predicted(rows, drafted[kind], cfg):.2f}x"
            lines.append(
                f"| {rows} | {kind} | {1000 * np.median(seconds):.0f} | "
                f"{1000 * seconds.min():.0f}-{1000 * seconds.max():.0f} | "
                f"{np.median(seconds / base):.2f}x | {model} |"
            )
    raw = {
        "machine": machine_line(),
        "date": str(datetime.date.today()),
        "results": {str(k): v for k, v in results.items()},
    }
    name = "verify_cost_long" if args.workload == "long" else "verify_cost"
    write_section(name, "\n".join(lines), raw)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
