"""Cascade attention on its own: one layer's decode pass (SmolLM2's 9 query heads over 3 KV
heads, head_dim 64, pages of 16, float32) for B rows that share a C-token prefix and hold 32
tokens each after it, read with the shared pass (etjax/attention/cascade.py) against each
row reading its whole context, for shared tiles of several sizes.

Both plans run in one compiled program per shape, interleaved, medians of the rounds after a
first call; the outputs are compared. Writes the "cascade" section of docs/PERF.md unless
--no-write.

    .venv/bin/python benchmarks/cascade.py [--rounds 15] [--no-write]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import statistics
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))

from benchmarks.perf_report import machine_line, median_spread, write_section

HEADS, KV_HEADS, HEAD_DIM, PAGE, TAIL, STEPS = 9, 3, 64, 16, 32, 8
CASES = [(2, 2048), (3, 2048), (4, 2048), (8, 512), (8, 2048), (8, 8192), (16, 2048), (32, 2048)]
TILES = (8, 16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    raw = {"machine": machine_line(), "date": str(datetime.date.today()), "rows": []}
    for rows, context in CASES:
        for tile in TILES:
            row = _case(rows, context, tile, args.rounds)
            print(row, flush=True)
            raw["rows"].append(row)
    if not args.no_write:
        write_section("cascade", _markdown(raw, args), raw)


def _case(rows: int, context: int, tile: int, rounds: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from etjax.attention import PlanSizes, plan_passes, plan_segments
    from etjax.attention.cascade import shared_prefixes
    from pallas_kernels.ragged_attention import Segment, ragged_attention_xla

    shared_pages = context // PAGE
    own = -(-(TAIL + STEPS) // PAGE) + 1
    num_pages = shared_pages + rows * own + 1
    rng = np.random.default_rng(0)
    shape = (num_pages, KV_HEADS, PAGE, HEAD_DIM)
    k = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    v = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    q = jnp.asarray(rng.standard_normal((rows, HEADS, HEAD_DIM)), jnp.float32)
    prefix = list(range(1, shared_pages + 1))
    position = context + TAIL
    segments = []
    for b in range(rows):
        first = shared_pages + 1 + b * own
        pages = (prefix + list(range(first, first + own)))[: (position + STEPS - 1) // PAGE + 1]
        segments.append(Segment(b, 1, position, position + STEPS - 1, pages))
    sizes = {
        "max_seq_pages": shared_pages + own,
        "pages_shared": True,
    }
    plain = plan_segments(segments, rows, PlanSizes.decode(rows, num_pages, PAGE, **sizes))
    cascade_sizes = PlanSizes.decode(rows, num_pages, PAGE, **sizes, cascade=True)
    cascade_sizes = dataclasses.replace(
        cascade_sizes, shared=dataclasses.replace(cascade_sizes.shared, q_tile=tile)
    )
    # Every group of rows gets a tile here (min_rows=1): the point is what each size costs.
    own, prefixes = shared_prefixes(segments, PAGE, cascade_sizes.shared.kv_tile, tile, 1)
    cascade = plan_passes([own], rows, cascade_sizes, shared=prefixes)
    positions = jnp.full((rows,), position, jnp.int32)
    # The XLA loops, and (where it builds) the CPU kernel the engine runs on a CPU.
    from cpp_kernels import cpu_kernels_available
    from pallas_kernels.ragged_attention.cpu import ragged_pass_cpu

    kernels = {"xla": None}
    if cpu_kernels_available():
        kernels["cpu"] = ragged_pass_cpu
    run = jax.jit(
        lambda passes, shared, native_pass: ragged_attention_xla(
            q, k, v, positions, passes, 16, shared_last=shared, native_pass=native_pass
        ),
        static_argnums=(1, 2),
    )
    plans = {
        f"{plan} {kernel}": (p, kernels[kernel])
        for kernel in kernels
        for plan, p in (("plain", plain), ("cascade", cascade))
    }
    outs = {
        name: run(p.passes, p.shared, narrow).block_until_ready()
        for name, (p, narrow) in plans.items()
    }
    times: dict[str, list[float]] = {name: [] for name in plans}
    for _ in range(rounds):
        for name, (p, narrow) in plans.items():
            started = time.perf_counter()
            run(p.passes, p.shared, narrow).block_until_ready()
            times[name].append((time.perf_counter() - started) * 1e3)
    error = max(float(jnp.max(jnp.abs(outs["plain xla"] - out))) for out in outs.values())
    return {"rows": rows, "context": context, "tile": tile, "ms": times, "max_abs_diff": error}


def _markdown(raw: dict, args) -> str:
    lines = [
        "## Cascade attention: one layer's decode pass over a shared prefix (SmolLM2 shapes)",
        "",
        f"{raw['machine']}, {raw['date']}. `benchmarks/cascade.py --rounds {args.rounds}`: "
        f"B rows share a C-token prefix and hold {TAIL} tokens each after it; one layer's "
        "decode pass (9 query heads, 3 KV heads, head_dim 64, pages of 16, float32) with "
        "each row reading its whole context (plain) and with the shared pass (cascade) in "
        "shared tiles of 8 or 16 rows, on the XLA loops and on the CPU kernel (cpp_kernels, "
        "the `cpu` backend: its own passes and the shared one). Milliseconds, median "
        "(min-max), interleaved; the difference is the largest between any variant and the "
        "XLA plain pass.",
        "",
        "| rows | context | shared tile | kernels | plain ms | cascade ms | cascade / plain "
        "| cascade / XLA plain | max abs diff |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in raw["rows"]:
        ms = row["ms"]
        xla_plain = statistics.median(ms["plain xla"])
        for kernel in ("xla", "cpu"):
            if f"plain {kernel}" not in ms:
                continue
            plain, cascade = ms[f"plain {kernel}"], ms[f"cascade {kernel}"]
            ratio = statistics.median(cascade) / statistics.median(plain)
            lines.append(
                f"| {row['rows']} | {row['context']} | {row['tile']} | {kernel} | "
                f"{median_spread(plain)} | {median_spread(cascade)} | {ratio:.2f}x | "
                f"{statistics.median(cascade) / xla_plain:.2f}x | {row['max_abs_diff']:.1e} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
