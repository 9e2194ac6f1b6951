"""One mixture-of-experts layer's experts on a CPU: the C++ grouped-products kernel against
XLA's `ragged_dot_general`, side by side in one process.

A layer of Qwen3-30B-A3B's shape (128 experts, D = 2048, experts' width M = 768) at a decode
step of T = 8 tokens, with k = 2 and with its own k = 8, in float32 (the engine's dtype on a
CPU) and in bfloat16 (a bfloat16 model: rows and weights); and a prompt chunk of 256 tokens on
a small Mixtral-like layer (8 experts, k = 2), where XLA's expansion costs least. Each case
times `routed_experts` (etjax/model/experts.py: routing, the two grouped products, the
weighted sum) compiled with the kernel (`row_products(True)`, what the engine's CPU step
programs run) and without it (XLA's lowering, which expands the rows to every expert and
masks them), alternating, after one untimed call of each, `block_until_ready` before each
clock read. XLA's calls at Qwen3's shape take seconds, so it is timed for the first
`--xla-rounds` rounds only. The two outputs are checked against each other.

FLOPs: routed = 2 x rows in groups x 3 D M (each routed row's gate|up and down products);
the kernel executes exactly those. XLA's executed FLOPs are its own `cost_analysis()` of the
two grouped products alone (its expansion contracts every row with every expert: E times the
routed count). Writes the "expert_products" section of docs/PERF.md with `--write`.

    .venv/bin/python benchmarks/expert_products.py [--rounds 12] [--write]

`--blocks`: the kernel's two grouped products of a Qwen3-30B-A3B layer (gate|up [128, 1536,
2048], down [128, 2048, 768]) with the experts kept in blocks (etjax/model/quantized.py: int8
per channel and the GGUF formats, random values in each format's layout) against the same
products on float32 experts, for a decode step of 1 and 8 tokens and a 64-token prompt chunk,
k = 8 distinct experts a token drawn at random; process CPU seconds per call (both threads;
the machine is shared, so CPU time, not wall time), median over the rounds after one untimed
call, float32 and the formats alternating. Prints its table; writes nothing.

    .venv/bin/python benchmarks/expert_products.py --blocks [--rounds 8] [--tokens 1,8,64]
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.perf_report import machine_line, median_spread, write_section
from cpp_kernels import cpu_kernels_available
from etjax.model.experts import expert_groups, route, routed_experts
from etjax.model.products import grouped_product, row_products
from etjax.model.quantized import FORMATS, QuantizedWeight, weights_bytes

# name, experts E, hidden D, expert width M, top k, tokens T, the model's dtype
CASES = (
    ("Qwen3-30B-A3B layer, decode, k = 2", 128, 2048, 768, 2, 8, "float32"),
    ("Qwen3-30B-A3B layer, decode, k = 8 (its own)", 128, 2048, 768, 8, 8, "float32"),
    ("Qwen3-30B-A3B layer, decode, k = 2", 128, 2048, 768, 2, 8, "bfloat16"),
    ("Mixtral-like small layer, 256-token chunk, k = 2", 8, 1024, 512, 2, 256, "float32"),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--xla-rounds", type=int, default=3, help="of the rounds, XLA's")
    parser.add_argument("--cases", default="", help="indices into CASES (default: all)")
    parser.add_argument("--write", action="store_true", help="write docs/PERF.md's section")
    parser.add_argument("--blocks", action="store_true", help="experts in blocks vs float32")
    parser.add_argument("--tokens", default="1,8,64", help="with --blocks: tokens a step")
    parser.add_argument("--formats", default="int8,q8_0,q4_0,q4_1,q4_k,q6_k")
    args = parser.parse_args()
    if not cpu_kernels_available():
        raise SystemExit("the CPU kernels are not built (no C++ compiler?)")
    if args.blocks:
        tokens = [int(t) for t in args.tokens.split(",")]
        print(_blocks_table(tokens, args.formats.split(","), args.rounds))
        return
    chosen = [CASES[int(i)] for i in args.cases.split(",") if i] or list(CASES)
    rows = []
    for case in chosen:
        row = _case(*case, rounds=args.rounds, xla_rounds=args.xla_rounds)
        rows.append(row)
        print(row, flush=True)
    raw = {
        "machine": machine_line(),
        "date": str(datetime.date.today()),
        "load_before": os.getloadavg()[0],
        "command": f"benchmarks/expert_products.py {shlex.join(sys.argv[1:])}",
        "xla_rounds": args.xla_rounds,
        "rows": rows,
    }
    markdown = _markdown(raw)
    if args.write:
        write_section("expert_products", markdown, raw)
    print(markdown)


def _case(name, e, d, m, k, t, dtype, rounds, xla_rounds):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((t, d)), dtype)
    router = jnp.asarray(rng.standard_normal((e, d)) * d**-0.5, dtype)
    w_gate_up = jnp.asarray(rng.standard_normal((e, 2 * m, d)) * d**-0.5, dtype)
    w_down = jnp.asarray(rng.standard_normal((e, d, m)) * m**-0.5, dtype)
    args = (x, router, w_gate_up, w_down)

    def compiled(kernel: bool):
        with row_products(kernel):
            # A new function for each: jax caches a trace by function, not by the context.
            return jax.jit(lambda *a: routed_experts(*a, k, True)).lower(*args).compile()

    kernel, xla = compiled(True), compiled(False)
    out_kernel, out_xla = (np.asarray(f(*args), np.float32) for f in (kernel, xla))
    scale = float(np.abs(out_xla).max())
    error = float(np.abs(out_kernel - out_xla).max()) / scale

    _, experts = route(x, router, k, True)
    sizes = np.asarray(expert_groups(experts, e)[2])
    routed = 2 * int(sizes.sum()) * 3 * d * m
    executed_xla = _xla_product_flops(t * k, d, m, e, w_gate_up, w_down, dtype)

    times = {"kernel": [], "xla": []}
    for i in range(rounds):
        for label, f in (("kernel", kernel), ("xla", xla)):
            if label == "xla" and i >= xla_rounds:
                continue
            started = time.perf_counter()
            jax.block_until_ready(f(*args))
            times[label].append((time.perf_counter() - started) * 1e3)
    return {
        "case": name,
        "experts": e,
        "hidden": d,
        "expert_width": m,
        "top_k": k,
        "tokens": t,
        "dtype": dtype,
        "experts_with_rows": int((sizes > 0).sum()),
        "routed_flops": routed,
        "xla_executed_flops": executed_xla,
        "max_relative_difference": error,
        "kernel_ms": times["kernel"],
        "xla_ms": times["xla"],
    }


# Qwen3-30B-A3B's layer: E experts, hidden D, experts' width M, k experts a token.
_QWEN3_30B = dict(e=128, d=2048, m=768, k=8)


def _random_blocks(fmt, e: int, n: int, width: int, rng) -> QuantizedWeight:
    # Experts [e, n, width] in `fmt`'s layout (formats.py), random values: the products' cost
    # does not depend on them.
    if fmt.bits == 4:
        quants = rng.integers(0, 256, (e, n, width // 2), dtype=np.uint8)
    else:
        quants = rng.integers(-127, 128, (e, n, width), dtype=np.int8)
    blocks = width // fmt.block_size(width)
    scales = (rng.random((e, n, blocks), np.float32) * 1e-3).astype(fmt.scale_dtype)
    offsets = -scales * 8 if fmt.offsets else None
    put = lambda a: None if a is None else jax.device_put(a)  # noqa: E731
    return QuantizedWeight(put(quants), put(scales), put(offsets), fmt, (e, n, width))


def _blocks_table(tokens: list[int], formats: list[str], rounds: int) -> str:
    e, d, m, k = (_QWEN3_30B[key] for key in ("e", "d", "m", "k"))
    rng = np.random.default_rng(0)
    floats = (
        jax.device_put(rng.standard_normal((e, 2 * m, d), np.float32) * d**-0.5),
        jax.device_put(rng.standard_normal((e, d, m), np.float32) * m**-0.5),
    )
    held = {"float32": floats}
    for name in formats:
        fmt = FORMATS[name]
        held[name] = (_random_blocks(fmt, e, 2 * m, d, rng), _random_blocks(fmt, e, d, m, rng))
    nbytes = {name: weights_bytes(w) / e for name, w in held.items()}

    def products(x, h, gu, dn, s):
        return grouped_product(x, gu, s), grouped_product(h, dn, s)

    step = jax.jit(products)  # traced, on the kernel, where first called (below)

    lines = [
        f"Experts' grouped products on the kernel, Qwen3-30B-A3B layer (E {e}, D {d}, M {m}, "
        f"k {k}): CPU ms per call (process time, median of {rounds}), float32 / format.",
        "",
        "| tokens (rows, experts with rows) | " + " | ".join(held) + " |",
        "|---" * (len(held) + 1) + "|",
        "| bytes an expert, MB | " + " | ".join(f"{nbytes[n] / 1e6:.2f}" for n in held) + " |",
    ]
    for t in tokens:
        experts = np.stack([rng.permutation(e)[:k] for _ in range(t)]).reshape(-1)
        sizes = jnp.asarray(np.bincount(experts, minlength=e), jnp.int32)
        x = jnp.asarray(rng.standard_normal((t * k, d)), jnp.float32)
        h = jnp.asarray(rng.standard_normal((t * k, m)), jnp.float32)
        cpu = {name: [] for name in held}
        with row_products(True):
            for gu, dn in held.values():
                jax.block_until_ready(step(x, h, gu, dn, sizes))  # compiled, and warm
            for _ in range(rounds):
                for name, (gu, dn) in held.items():
                    started = time.process_time()
                    jax.block_until_ready(step(x, h, gu, dn, sizes))
                    cpu[name].append((time.process_time() - started) * 1e3)
        base = statistics.median(cpu["float32"])
        cells = [f"{base:.2f}"] + [
            f"{statistics.median(cpu[n]):.2f} ({base / statistics.median(cpu[n]):.2f}x)"
            for n in held
            if n != "float32"
        ]
        used = int((np.asarray(sizes) > 0).sum())
        lines.append(f"| {t} ({t * k}, {used}) | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _xla_product_flops(rows, d, m, e, w_gate_up, w_down, dtype) -> float:
    # XLA's own count of its two grouped products (rows in groups: all of them).
    sizes = jax.ShapeDtypeStruct((e,), jnp.int32)

    def products(x, h, gu, dn, s):
        return grouped_product(x, gu, s), grouped_product(h, dn, s)

    with row_products(False):
        lowered = jax.jit(products).lower(
            jax.ShapeDtypeStruct((rows, d), dtype),
            jax.ShapeDtypeStruct((rows, m), dtype),
            w_gate_up,
            w_down,
            sizes,
        )
    analysis = lowered.compile().cost_analysis()
    analysis = analysis[0] if isinstance(analysis, list) else analysis
    return float(analysis["flops"])


def _markdown(raw) -> str:
    lines = [
        "## Routed experts on a CPU: the grouped-products kernel against XLA's ragged dot",
        "",
        f"Measured {raw['date']} on {raw['machine']}; load average {raw['load_before']:.2f} "
        f"before the run (the machine is shared). Command: `.venv/bin/python "
        f"{raw['command']}`. One layer's `routed_experts` (routing, both grouped products, "
        "the weighted sum) in the model's dtype (rows and weights), random routing "
        "renormalised over the top k; milliseconds per call, median (min-max) over the timed "
        "calls after one untimed call of each, the kernel and XLA alternating (XLA's first "
        f"{raw['xla_rounds']} rounds only: its calls take seconds). FLOPs of the grouped "
        "products: routed = 2 x rows in groups x 3 D M, which the kernel executes; XLA's "
        "from its own `cost_analysis()`.",
        "",
        "| case | E / D / M / k / T | dtype | experts with rows | executed / routed FLOPs, "
        "kernel / XLA | kernel ms | XLA ms | XLA / kernel | max difference / max output |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in raw["rows"]:
        ratio = statistics.median(r["xla_ms"]) / statistics.median(r["kernel_ms"])
        lines.append(
            f"| {r['case']} | {r['experts']} / {r['hidden']} / {r['expert_width']} / "
            f"{r['top_k']} / {r['tokens']} | {r['dtype']} | {r['experts_with_rows']} of "
            f"{r['experts']} | 1.0 / {r['xla_executed_flops'] / r['routed_flops']:.1f} | "
            f"{median_spread(r['kernel_ms'])} | {median_spread(r['xla_ms'])} | "
            f"**{ratio:.1f}x** | {r['max_relative_difference']:.1e} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
