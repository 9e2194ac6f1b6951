"""FCFS vs entropic scheduling on a mixed Lee workload (SmolLM2, this CPU).

64 requests of the `mixed` workload (benchmarks/workloads.py), sampled at T = 0.7 with a seed
per request, so every policy produces the same tokens and does the same work; only when each
request runs differs. Two arrival patterns: all submitted at once, and Poisson arrivals at
about 80% of the capacity measured in the all-at-once FCFS run. Policies, at equal device
batch (32 slots):

- `fcfs`: vLLM's baseline, every resident sequence in the batch (64 resident would need
  preemption-free memory for all; here resident = batch = 32);
- `fcfs, 64 resident`: the same engine sizes as the entropic run, ordered by arrival;
- `entropic, 64 resident`: 64 resident sequences, the 32 with the highest expected entropy
  reduction per byte decode each round (minimum advancement every 4 rounds).

Reports throughput, mean/p50/p99 end-to-end latency, mean time to first token, d tau / d C
(total entropic time over total bytes read), the worst per-request latency ratio against FCFS,
and host time per decode step. Writes the "scheduling" section of docs/PERF.md.

    .venv/bin/python benchmarks/scheduling.py [--requests 64]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import shlex
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.perf_report import machine_line, write_section
from benchmarks.workloads import mixed, poisson_arrivals
from etjax.runtime.generate import build_engine, workload_pages
from etjax.runtime.options import RequestSettings, RuntimeOptions
from etjax.sampling.settings import SamplerSettings

BATCH, STEPS = 32, 8
POLICIES = {
    "fcfs": dict(policy="fcfs", max_resident=BATCH),
    "fcfs, 64 resident": dict(policy="fcfs", max_resident=2 * BATCH),
    "entropic, 64 resident": dict(policy="entropic", max_resident=2 * BATCH),
}


def run(model, prompts, settings, options: RuntimeOptions, arrivals) -> dict:
    pages = workload_pages(prompts, settings, options)
    engine = build_engine(model.weights, model.config, model.tokenizer, options, pages)
    start = time.perf_counter()
    handles = [
        engine.submit(p, s, arrival_time=start + a)
        for p, s, a in zip(prompts, settings, arrivals, strict=True)
    ]
    while engine.step():
        live = [s for s in engine.sequences if not s.finished]
        if live and all(s.arrival_time > time.perf_counter() for s in live):
            time.sleep(max(min(s.arrival_time for s in live) - time.perf_counter(), 0.0))
    makespan = time.perf_counter() - start
    outs = [h.result() for h in handles]
    latency = np.array([o.metrics["end_to_end_latency"] for o in outs])
    ttft = np.array([o.metrics["time_to_first_token"] for o in outs])
    tokens = sum(len(o.token_ids) for o in outs)
    steps = engine.decode_rounds * STEPS
    return {
        "throughput": tokens / makespan,
        "makespan_s": makespan,
        "tokens": tokens,
        "latency": latency.tolist(),
        "latency_mean": float(latency.mean()),
        "latency_p50": float(np.percentile(latency, 50)),
        "latency_p99": float(np.percentile(latency, 99)),
        "ttft_mean": float(ttft.mean()),
        "dtau_dc": sum(o.metrics["tau"] for o in outs) / sum(o.metrics["cost_bytes"] for o in outs),
        "host_ms_per_step": 1e3 * engine.host_seconds / max(steps, 1),
        "device_ms_per_step": 1e3 * engine.device_seconds / max(steps, 1),
        "preemptions": int(sum(o.metrics["preemptions"] for o in outs)),
        "token_ids": [o.token_ids for o in outs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    args = parser.parse_args()
    import etjax
    from tests.conftest import lee_articles

    model = etjax.load_model()
    workload = mixed(model.tokenizer, lee_articles(), args.requests, seed=0)
    prompts = [model.tokenizer.encode(r.prompt) for r in workload]
    settings = [
        RequestSettings(r.max_new_tokens, sampler=SamplerSettings(temperature=0.7, seed=i))
        for i, r in enumerate(workload)
    ]
    base = RuntimeOptions(max_batch_size=BATCH, steps_per_sync=STEPS)
    # Warm-up, not measured: the whole workload once, so the programs its shapes need (prefill
    # chunks, batch sizes, page-table widths) are compiled before any policy is timed.
    run(
        model,
        prompts,
        settings,
        dataclasses.replace(base, **POLICIES["fcfs"]),
        np.zeros(len(prompts)),
    )

    results: dict[str, dict] = {}
    at_once = np.zeros(len(prompts))
    for name, overrides in POLICIES.items():
        results[f"at once / {name}"] = run(
            model, prompts, settings, dataclasses.replace(base, **overrides), at_once
        )
        print(
            name,
            {
                k: v
                for k, v in results[f"at once / {name}"].items()
                if k not in ("latency", "token_ids")
            },
            flush=True,
        )
    capacity = len(prompts) / results["at once / fcfs"]["makespan_s"]
    arrivals = poisson_arrivals(len(prompts), 0.8 * capacity, seed=1)
    for name in ("fcfs", "entropic, 64 resident"):
        results[f"Poisson / {name}"] = run(
            model, prompts, settings, dataclasses.replace(base, **POLICIES[name]), arrivals
        )
        print(
            name,
            {
                k: v
                for k, v in results[f"Poisson / {name}"].items()
                if k not in ("latency", "token_ids")
            },
            flush=True,
        )
    same = all(r["token_ids"] == results["at once / fcfs"]["token_ids"] for r in results.values())
    _report(results, capacity, same, args, workload)


def _scalars(result: dict) -> dict:
    return {k: v for k, v in result.items() if k not in ("latency", "token_ids")}


def _show(name: str, result: dict) -> None:
    print(name, _scalars(result), flush=True)


def _report(results, capacity, same, args, workload) -> None:
    raw = {
        "machine": machine_line(),
        "date": str(datetime.date.today()),
        "capacity_requests_per_s": capacity,
        "identical_outputs": same,
        "results": {
            k: {kk: vv for kk, vv in v.items() if kk != "token_ids"} for k, v in results.items()
        },
    }
    kinds = {
        k: sum(r.kind == k for r in workload) for k in ("summarise", "continue", "question", "long")
    }
    lines = [
        "## Scheduling: FCFS vs entropic on a mixed workload (SmolLM2, batch 32)",
        "",
        f"Measured {raw['date']} on {raw['machine']}. Command: `.venv/bin/python "
        f"benchmarks/scheduling.py {shlex.join(sys.argv[1:])}`. {args.requests} requests of the "
        f"`mixed` workload ({', '.join(f'{v} {k}' for k, v in kinds.items())}; 64-256 new "
        "tokens), T = 0.7 with a seed per request. Poisson arrivals at 80% of the capacity "
        f"measured by at-once FCFS ({capacity:.2f} requests/s). Outputs identical across all "
        f"runs: {'yes' if same else 'NO'}. Ratios are against FCFS in the same arrival pattern.",
        "",
        "| arrivals / policy | throughput tok/s | latency mean s | p50 | p99 | TTFT mean s | "
        "d tau / d C (per GB) | worst latency ratio | host ms / step | preemptions |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        pattern = name.split(" / ")[0]
        ref = results[f"{pattern} / fcfs"]
        worst = float(np.max(np.array(r["latency"]) / np.array(ref["latency"])))
        lines.append(
            f"| {name} | {r['throughput']:.1f} ({r['throughput'] / ref['throughput']:.2f}x) | "
            f"{r['latency_mean']:.1f} ({r['latency_mean'] / ref['latency_mean']:.2f}x) | "
            f"{r['latency_p50']:.1f} | {r['latency_p99']:.1f} | {r['ttft_mean']:.1f} | "
            f"{r['dtau_dc'] * 1e9:.3f} ({r['dtau_dc'] / ref['dtau_dc']:.2f}x) | {worst:.2f} | "
            f"{r['host_ms_per_step']:.2f} | {r['preemptions']} |"
        )
    write_section("scheduling", "\n".join(lines), raw)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
