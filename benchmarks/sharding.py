"""Decode throughput of SmolLM2 on meshes of 1, 2, 4 and 8 forced CPU devices.

The same workload (8 Lee-article prompts of 128 tokens, 64 greedy new tokens each, batch 8)
on several meshes, side by side in one process whose JAX sees 8 host devices (the script
re-executes itself with XLA_FLAGS=--xla_force_host_platform_device_count=8). The forced
devices share this machine's cores, so this measures what sharding costs (the collectives XLA
inserts, smaller per-device programs), not a speed-up. Every mesh must produce the one-device
tokens. Writes the "sharding" section of docs/PERF.md.

    .venv/bin/python benchmarks/sharding.py [--meshes 1x1,1x2,1x4,1x8,2x1,4x1,8x1,2x4]
    .venv/bin/python benchmarks/sharding.py --native --meshes 1x1,1x2,1x4,1x8   # on GPUs/TPUs
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

FORCED = "--xla_force_host_platform_device_count=8"
BATCH, PROMPT_TOKENS, NEW_TOKENS = 8, 128, 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--meshes", default="1x1,1x2,1x4,1x8,2x1,4x1,8x1,2x4")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--native", action="store_true", help="use this host's own devices (GPUs, TPUs)"
    )
    args = parser.parse_args()
    if not args.native and FORCED not in os.environ.get("XLA_FLAGS", ""):
        env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {FORCED}".strip())
        env["JAX_PLATFORMS"] = "cpu"
        sys.exit(subprocess.call([sys.executable, *sys.argv], env=env))

    import jax
    import numpy as np

    import etjax
    from benchmarks.perf_report import machine_line, median_spread, write_section
    from etjax.bench.corpus import lee_articles
    from etjax.engine_build import generate_ids
    from etjax.runtime.options import RequestSettings, RuntimeOptions

    model = etjax.load_model()
    articles = lee_articles()
    prompts = [model.tokenizer.encode(articles[i])[:PROMPT_TOKENS] for i in range(BATCH)]
    settings = [RequestSettings(NEW_TOKENS, ignore_eos=True)] * BATCH
    meshes = args.meshes.split(",")

    def run(mesh: str):
        options = RuntimeOptions(max_batch_size=BATCH, mesh=mesh)
        started = time.perf_counter()
        outs = generate_ids(
            model.weights, model.config, model.tokenizer, prompts, settings, options
        )
        return time.perf_counter() - started, [o.token_ids for o in outs]

    tokens, seconds = {}, {m: [] for m in meshes}
    for mesh in meshes:  # warm-up: compile every mesh's programs
        tokens[mesh] = run(mesh)[1]
        print("compiled", mesh, flush=True)
    for _ in range(args.repeats):
        for mesh in meshes:  # interleaved
            elapsed, out = run(mesh)
            seconds[mesh].append(elapsed)
            assert out == tokens[mesh]
    reference = tokens[meshes[0]]
    rates = {m: [BATCH * NEW_TOKENS / s for s in seconds[m]] for m in meshes}
    raw = {
        "machine": machine_line(),
        "devices": jax.device_count(),
        "date": str(datetime.date.today()),
        "tokens_per_s": rates,
        "same_tokens_as_first": {m: tokens[m] == reference for m in meshes},
    }
    base = float(np.median(rates[meshes[0]]))
    where = jax.default_backend().upper() if args.native else "forced CPU"
    lines = [
        f"## Sharding: decode throughput on {where} devices (SmolLM2)",
        "",
        f"Measured {raw['date']} on {raw['machine']}, {raw['devices']} "
        + ("devices" if args.native else "forced host devices sharing its cores")
        + ". Command: `.venv/bin/python benchmarks/sharding.py "
        f"{shlex.join(sys.argv[1:])}`. {BATCH} prompts of {PROMPT_TOKENS} tokens, "
        f"{NEW_TOKENS} greedy new tokens each, generate end to end (prefill included) after a "
        f"warm-up per mesh; {args.repeats} repetitions interleaved, median (min-max)."
        + (
            ""
            if args.native
            else " The devices share the cores, so this is the cost of sharding, not a speed-up."
        ),
        "",
        "| mesh (data x model) | devices | tokens/s | vs 1x1 | same tokens as 1x1 |",
        "|---|---|---|---|---|",
    ]
    for mesh in meshes:
        d, m = (int(x) for x in mesh.split("x"))
        lines.append(
            f"| {mesh} | {d * m} | {median_spread(rates[mesh])} | "
            f"{float(np.median(rates[mesh])) / base:.2f}x | "
            f"{'yes' if tokens[mesh] == reference else 'NO'} |"
        )
    # A native run keeps its own section beside the forced-CPU one.
    write_section("sharding_native" if args.native else "sharding", "\n".join(lines), raw)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
