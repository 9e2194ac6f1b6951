"""Entropic speculation against the same engine without it, on the mixed Lee workload
(SmolLM2, this CPU).

Two settings, each run with speculation off and on, side by side after a warm-up run of each
(compilation excluded):

- batch 1, greedy: every request alone, in order (a latency user); the target is a mean
  latency per request of at most 0.6x;
- batch 32, T = 0.7 with a seed per request (the ablation's baseline): the target is no loss
  of throughput, which the entropy rule and the draft budget should ensure.

Speculation changes no output beyond float rounding (etjax/runtime/verify.py); the script
checks that the tokens are identical and, where they are not, names where each request parts
and how likely both draws there were. Reports latency, throughput, passes per token and, by
prompt kind, the drafted tokens, acceptance rate and passes per token. Writes the
"speculation" section of docs/PERF.md.

    .venv/bin/python benchmarks/speculation.py [--requests 12] [--batch-requests 32]

With `--sweep`, instead: batch 1, greedy only, speculation off and then on with each setting
of the draft-length rule in `SWEEP` (one constant changed from the defaults at a time), side
by side in one run; writes the "speculation_sweep" section.
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
from etjax.bench.measure import measure, summarise
from etjax.bench.workloads import mixed
from etjax.drafting import SpeculationConfig
from etjax.run_config import RunConfig
from etjax.runtime.options import RuntimeOptions
from etjax.sampling.settings import SamplerSettings

KINDS = ("summarise", "question", "continue", "long")
# The rule's constants (etjax/drafting/config.py), each moved off its default alone.
SWEEP = {
    "defaults": {},
    "entropy_max 0.75": {"entropy_max": 0.75},
    "entropy_max 3.0": {"entropy_max": 3.0},
    "min_survival 0.1": {"min_survival": 0.1},
    "min_survival 0.5": {"min_survival": 0.5},
    "max_draft 3": {"max_draft": 3},
    "acceptance_prior 0.8": {"acceptance_prior": 0.8},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=12, help="batch-1 requests")
    parser.add_argument("--batch-requests", type=int, default=32, help="batch-32 requests")
    parser.add_argument(
        "--sweep", action="store_true", help="batch 1, greedy: the rule's constants varied"
    )
    args = parser.parse_args()
    import etjax
    from etjax.bench.corpus import lee_articles

    model = etjax.load_model()
    articles = lee_articles()
    if args.sweep:
        _sweep(model, mixed(model.tokenizer, articles, args.requests, seed=0))
        return
    settings = {
        "batch 1, greedy": (1, True, mixed(model.tokenizer, articles, args.requests, seed=0)),
        "batch 32, T = 0.7": (
            32,
            False,
            mixed(model.tokenizer, articles, args.batch_requests, seed=0),
        ),
    }
    results, identical = {}, {}
    for setting, (batch, greedy, workload) in settings.items():
        at_once = np.zeros(len(workload))
        runs = {}
        for name, enabled in (("off", False), ("on", True)):
            options = RuntimeOptions(
                max_batch_size=batch, speculation=SpeculationConfig(enabled=enabled)
            )
            config = RunConfig(name, options=options, sampler=SamplerSettings(temperature=0.7))
            measure(model, config, workload, at_once, greedy=greedy)  # warm-up: compiles
            runs[name] = (config, workload)
        for name, (config, workload) in runs.items():
            results[(setting, name)] = measure(model, config, workload, at_once, greedy=greedy)
            print(setting, name, summarise(results[(setting, name)]), flush=True)
        identical[setting] = parting(results[(setting, "off")], results[(setting, "on")])
    _report(results, identical, settings, args)


def _sweep(model, workload) -> None:
    # Batch 1, greedy: off, then each rule setting. Before any run is timed, one run per
    # distinct program shape (max_draft is static; the other constants are host-side).
    at_once = np.zeros(len(workload))
    variants = {"off": SpeculationConfig()} | {
        name: SpeculationConfig(enabled=True, **change) for name, change in SWEEP.items()
    }
    configs, warmed = {}, set()
    for name, speculation in variants.items():
        options = RuntimeOptions(max_batch_size=1, speculation=speculation)
        configs[name] = RunConfig(name, options=options, sampler=SamplerSettings())
        shape = (speculation.enabled, speculation.max_draft)
        if shape not in warmed:
            measure(model, configs[name], workload, at_once, greedy=True)
            warmed.add(shape)
    results = {}
    for name, config in configs.items():
        results[name] = summarise(measure(model, config, workload, at_once, greedy=True))
        print(name, results[name], flush=True)
    ref = results["off"]
    lines = [
        "## Speculation: the draft-length rule's constants (SmolLM2, batch 1, greedy)",
        "",
        f"Measured {datetime.date.today()} on {machine_line()}. Command: `.venv/bin/python "
        f"benchmarks/speculation.py {shlex.join(sys.argv[1:])}`. The `mixed` workload "
        f"({len(workload)} requests, all submitted at once, one row); each row of the table "
        "changes one constant of the default `[speculation]` settings; one warm-up run per "
        "program shape first, then each setting once, in this order.",
        "",
        "| setting | latency mean s | throughput tok/s | passes / token | acceptance | "
        "accepted / verifying pass |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['latency_mean_s']:.1f} "
            f"({r['latency_mean_s'] / ref['latency_mean_s']:.2f}x) | "
            f"{r['throughput_tok_s']:.1f} ({r['throughput_tok_s'] / ref['throughput_tok_s']:.2f}x)"
            f" | {r['passes_per_token']:.2f} | {r['acceptance_rate']:.0%} | "
            f"{r['mean_accepted_length']:.2f} |"
        )
    raw = {"machine": machine_line(), "date": str(datetime.date.today()), "results": results}
    write_section("speculation_sweep", "\n".join(lines), raw)
    print("\n".join(lines))


def _by_kind(run: dict, workload) -> dict[str, dict[str, float]]:
    out = {}
    for kind in KINDS:
        reqs = [r for r, w in zip(run["requests"], workload, strict=True) if w.kind == kind]
        if not reqs:
            continue
        tokens = sum(r["generated_tokens"] for r in reqs)
        drafted = sum(r["drafted_tokens"] for r in reqs)
        accepted = sum(r["acceptance_rate"] * r["drafted_tokens"] for r in reqs)
        passes = sum(r["passes_per_token"] * r["generated_tokens"] for r in reqs)
        out[kind] = {
            "requests": len(reqs),
            "drafted_per_token": drafted / max(tokens, 1),
            "acceptance_rate": accepted / max(drafted, 1),
            "passes_per_token": passes / max(tokens, 1),
        }
    return out


def parting(off: dict, on: dict) -> str:
    """Whether two runs' outputs agree: "yes", or how many requests part and, for each, the
    token where it does with the model log-probability of both draws there (float rounding
    can flip a draw only where the tokens' CDF slots are that narrow, far in the tail)."""
    parts = []
    for i, (a, b) in enumerate(zip(off["requests"], on["requests"], strict=True)):
        x, y = a["token_ids"], b["token_ids"]
        if x == y:
            continue
        k = next(
            (k for k, (s, t) in enumerate(zip(x, y, strict=False)) if s != t), min(len(x), len(y))
        )
        logprobs = "/".join(
            f"{r['logprob'][k]:.1f}" if k < len(r["logprob"]) else "end" for r in (a, b)
        )
        parts.append(f"request {i} at token {k}, log-probabilities {logprobs}")
    if not parts:
        return "yes"
    return f"NO, {len(parts)} of {len(off['requests'])} requests part ({'; '.join(parts)})"


def _report(results, identical, settings, args) -> None:
    raw = {
        "machine": machine_line(),
        "date": str(datetime.date.today()),
        "identical_outputs": identical,
        "results": {f"{s} / {n}": summarise(r) for (s, n), r in results.items()},
        "by_kind": {s: _by_kind(results[(s, "on")], settings[s][2]) for s in settings},
        "speculation": dataclasses.asdict(SpeculationConfig(enabled=True)),
    }
    lines = [
        "## Speculation: prompt-lookup drafts verified in the ragged step (SmolLM2)",
        "",
        f"Measured {raw['date']} on {raw['machine']}. Command: `.venv/bin/python "
        f"benchmarks/speculation.py {shlex.join(sys.argv[1:])}`. The `mixed` workload, all "
        "requests submitted at once; each setting runs with speculation off and on (the "
        "default `[speculation]` settings) after a warm-up run of each. Outputs identical "
        "with and without: " + ", ".join(f"{s}: {same}" for s, same in identical.items()) + ".",
        "",
        "| setting | speculation | latency mean s | p99 s | TTFT mean s | throughput tok/s | "
        "passes / token | acceptance | accepted / verifying pass | compile s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (setting, name), run in results.items():
        r, ref = summarise(run), summarise(results[(setting, "off")])
        lines.append(
            f"| {setting} | {name} | {r['latency_mean_s']:.1f} "
            f"({r['latency_mean_s'] / ref['latency_mean_s']:.2f}x) | {r['latency_p99_s']:.1f} | "
            f"{r['ttft_mean_s']:.1f} | {r['throughput_tok_s']:.1f} "
            f"({r['throughput_tok_s'] / ref['throughput_tok_s']:.2f}x) | "
            f"{r['passes_per_token']:.2f} | {r['acceptance_rate']:.0%} | "
            f"{r['mean_accepted_length']:.2f} | {r['compile_s']:.1f} |"
        )
    lines += [
        "",
        "| setting | prompt kind | requests | drafted / token | acceptance | passes / token |",
        "|---|---|---|---|---|---|",
    ]
    for setting, kinds in raw["by_kind"].items():
        for kind, k in kinds.items():
            lines.append(
                f"| {setting} | {kind} | {k['requests']} | {k['drafted_per_token']:.2f} | "
                f"{k['acceptance_rate']:.0%} | {k['passes_per_token']:.2f} |"
            )
    write_section("speculation", "\n".join(lines), raw)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
