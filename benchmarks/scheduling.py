"""FCFS vs entropic scheduling on a mixed Lee workload (SmolLM2, this CPU).

64 requests of the `mixed` workload (etjax/bench/workloads.py), sampled at T = 0.7 with a seed
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
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.perf_report import machine_line, write_section
from etjax.bench.measure import measure, summarise
from etjax.bench.workloads import mixed, poisson_arrivals
from etjax.run_config import RunConfig
from etjax.runtime.options import RuntimeOptions
from etjax.sampling.settings import SamplerSettings

BATCH, STEPS = 32, 8
POLICIES = {
    "fcfs": dict(policy="fcfs", max_resident=BATCH),
    "fcfs, 64 resident": dict(policy="fcfs", max_resident=2 * BATCH),
    "entropic, 64 resident": dict(policy="entropic", max_resident=2 * BATCH),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    args = parser.parse_args()
    import etjax
    from etjax.bench.corpus import lee_articles

    model = etjax.load_model()
    workload = mixed(model.tokenizer, lee_articles(), args.requests, seed=0)
    base = RuntimeOptions(max_batch_size=BATCH, steps_per_sync=STEPS)
    sampler = SamplerSettings(temperature=0.7)

    def config(name: str) -> RunConfig:
        return RunConfig(name, options=dataclasses.replace(base, **POLICIES[name]), sampler=sampler)

    # Warm-up, not measured: the whole workload once under FCFS and once under the entropic
    # policy, so the programs its shapes need (prefill chunks, batch sizes, page-table widths)
    # are compiled before any policy is timed. Each timed run records what it still compiled.
    at_once = np.zeros(len(workload))
    for name in ("fcfs", "entropic, 64 resident"):
        measure(model, config(name), workload, at_once)

    results: dict[str, dict] = {}
    for name in POLICIES:
        results[f"at once / {name}"] = measure(model, config(name), workload, at_once)
        _show(f"at once / {name}", results[f"at once / {name}"])
    capacity = len(workload) / results["at once / fcfs"]["makespan_s"]
    arrivals = poisson_arrivals(len(workload), 0.8 * capacity, seed=1)
    for name in ("fcfs", "entropic, 64 resident"):
        results[f"Poisson / {name}"] = measure(model, config(name), workload, arrivals)
        _show(f"Poisson / {name}", results[f"Poisson / {name}"])
    tokens = {k: [r["token_ids"] for r in v["requests"]] for k, v in results.items()}
    same = all(t == tokens["at once / fcfs"] for t in tokens.values())
    _report(results, capacity, same, args, workload)


def _show(name: str, result: dict) -> None:
    print(name, summarise(result), flush=True)


def _latency(result: dict) -> np.ndarray:
    return np.array([r["end_to_end_latency"] for r in result["requests"]])


def _report(results, capacity, same, args, workload) -> None:
    raw = {
        "machine": machine_line(),
        "date": str(datetime.date.today()),
        "capacity_requests_per_s": capacity,
        "identical_outputs": same,
        "results": {
            k: {**summarise(v), "latency": _latency(v).tolist()} for k, v in results.items()
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
        "d tau / d C (nats/GB) | worst latency ratio | host ms / step | preemptions | "
        "compile s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, run in results.items():
        pattern = name.split(" / ")[0]
        ref, r = summarise(results[f"{pattern} / fcfs"]), summarise(run)
        worst = float(np.max(_latency(run) / _latency(results[f"{pattern} / fcfs"])))
        lines.append(
            f"| {name} | {r['throughput_tok_s']:.1f} "
            f"({r['throughput_tok_s'] / ref['throughput_tok_s']:.2f}x) | "
            f"{r['latency_mean_s']:.1f} ({r['latency_mean_s'] / ref['latency_mean_s']:.2f}x) | "
            f"{r['latency_p50_s']:.1f} | {r['latency_p99_s']:.1f} | {r['ttft_mean_s']:.1f} | "
            f"{r['dtau_dc_per_gb']:.3f} ({r['dtau_dc_per_gb'] / ref['dtau_dc_per_gb']:.2f}x) | "
            f"{worst:.2f} | {r['host_ms_per_step']:.2f} | {r['preemptions']} | "
            f"{r['compile_s']:.1f} |"
        )
    write_section("scheduling", "\n".join(lines), raw)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
