"""Products of float32 rows by quantized weights on a CPU: the block-products kernel against
the float32 row-products kernel and XLA's product of the dequantized float32 weights, side by
side in one process, on SmolLM2-135M's shapes.

Each projection shape of SmolLM2-135M (q/o 576x576, k/v 192x576, gate/up 1536x576, down
576x1536) is timed as its 30 layers' products in one compiled program, each layer its own
weight, so the weights stream from memory as in a step rather than sit in a cache; the tied
LM head (49152x576) is timed alone; "the whole step" is every projection of a decode step
(30 layers x 7 and the head) in one program. Weights are random, in Q4_1 (the file's format
for the layers) and Q8_0 (the head), as pallas_kernels/block_products/formats.py keeps them;
the float32 methods get the same weights dequantized; XLA also dequantizes the blocks in the
program (block_products_xla, the fallback). Rows: 1, 8, 32 (a decode step) and 256 (a prompt
chunk). Per method, milliseconds per program, median (min-max) over the timed calls after
one untimed call, the methods alternating within each round and `block_until_ready` before
each clock read; CPU time (the process's, all threads) is recorded beside wall-clock time:
on a shared machine it is the fairer comparison. The row-products kernel takes at most 32
rows. The kernel's outputs are checked against XLA's. Writes the "block_products" section of
docs/PERF.md with `--write`.

    .venv/bin/python benchmarks/block_products.py [--rounds 7] [--rows 1,8,32,256] [--write]
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
from pallas_kernels.block_products import formats
from pallas_kernels.block_products.cpu import (
    block_products_cpu,
    block_products_cpu_takes,
    int8_rows_cpu,
    int8_rows_cpu_takes,
)
from pallas_kernels.block_products.xla import block_products_xla, dequantize_xla
from pallas_kernels.row_products.cpu import row_products_cpu, row_products_cpu_takes
from pallas_kernels.row_products.xla import row_products_xla

LAYERS = 30
HIDDEN, KV, MLP, VOCAB = 576, 192, 1536, 49152
# name, (out, in), copies (one per layer), format
SHAPES = (
    ("q, o: 576x576", (HIDDEN, HIDDEN), 2 * LAYERS, formats.Q4_1),
    ("k, v: 192x576", (KV, HIDDEN), 2 * LAYERS, formats.Q4_1),
    ("gate, up: 1536x576", (MLP, HIDDEN), 2 * LAYERS, formats.Q4_1),
    ("down: 576x1536", (HIDDEN, MLP), LAYERS, formats.Q4_1),
    ("LM head: 49152x576", (VOCAB, HIDDEN), 1, formats.Q8_0),
)
METHODS = (
    "block kernel",
    "int8 rows kernel",
    "XLA dequantizing",
    "float32 row kernel",
    "XLA float32",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--rows", default="1,8,32,256")
    parser.add_argument("--shapes", default="", help="indices into SHAPES, 'step' the step")
    parser.add_argument("--write", action="store_true", help="write docs/PERF.md's section")
    args = parser.parse_args()
    if not cpu_kernels_available():
        raise SystemExit("the CPU kernels are not built (no C++ compiler?)")
    picked = args.shapes.split(",") if args.shapes else [*map(str, range(len(SHAPES))), "step"]
    load_before = os.getloadavg()[0]
    weights = {i: _weights(*SHAPES[int(i)][1:]) for i in picked if i != "step"}
    if "step" in picked:
        for i in range(len(SHAPES)):
            weights.setdefault(str(i), _weights(*SHAPES[i][1:]))
    results = []
    for rows in map(int, args.rows.split(",")):
        for i in picked:
            parts = [weights[str(j)] for j in range(len(SHAPES))] if i == "step" else [weights[i]]
            name = "the whole step" if i == "step" else SHAPES[int(i)][0]
            result = _case(name, parts, rows, args.rounds)
            results.append(result)
            print(result["name"], rows, {m: median_spread(t) for m, t in result["ms"].items()})
            print("  cpu", {m: median_spread(t) for m, t in result["cpu_ms"].items()})
    raw = {
        "machine": machine_line(),
        "date": str(datetime.date.today()),
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "command": f"benchmarks/block_products.py {shlex.join(sys.argv[1:])}",
        "results": results,
    }
    markdown = _markdown(raw)
    if args.write:
        write_section("block_products", markdown, raw)
    print(markdown)


def _weights(shape, copies, fmt):
    # `copies` weights of `shape` in `fmt` (random values of every quant and realistic
    # scales), as device arrays, and the float32 dequantization of each.
    out, width = shape
    rng = np.random.default_rng(out + width)
    block = fmt.block_size(width)
    quantized, interleaved, dense = [], [], []
    for _ in range(copies):
        if fmt.bits == 4:
            quants = rng.integers(0, 256, (out, width // 2), dtype=np.uint8)
        else:
            quants = rng.integers(-127, 128, (out, width), dtype=np.int8)
        scales = (rng.random((out, width // block)) * 0.01).astype(fmt.scale_dtype)
        offsets = -8 * scales if fmt.offsets else None
        arrays = tuple(None if a is None else jnp.asarray(a) for a in (quants, scales, offsets))
        quantized.append(arrays)
        mixed = formats.interleave(formats.BlockArrays(quants, scales, offsets), fmt)
        interleaved.append(tuple(None if a is None else jnp.asarray(a) for a in mixed))
        dense.append(dequantize_xla(*arrays, block, fmt.bits))
    return {
        "shape": shape,
        "format": fmt,
        "block": block,
        "q": quantized,
        "interleaved": interleaved,
        "f32": dense,
    }


def _programs(parts, rows):
    # One compiled program per method over every weight of `parts`: x for each input width.
    widths = sorted({p["shape"][1] for p in parts})
    xs = {w: jnp.asarray(np.random.default_rng(w).standard_normal((rows, w)), jnp.float32)
          for w in widths}  # fmt: skip

    def block_kernel(xs, quantized):
        outs = []
        for p, weights in zip(parts, quantized, strict=True):
            x = xs[p["shape"][1]]
            for arrays in weights:
                fmt = p["format"]
                assert block_products_cpu_takes(x, *arrays, p["block"], fmt.bits, jnp.float32)
                outs.append(block_products_cpu(x, *arrays, p["block"], fmt.bits))
        return outs

    def int8_rows_kernel(xs, interleaved):
        outs = []
        for p, weights in zip(parts, interleaved, strict=True):
            x = xs[p["shape"][1]]
            for arrays in weights:
                assert int8_rows_cpu_takes(x, *arrays, p["block"], p["format"].bits, jnp.float32)
                outs.append(int8_rows_cpu(x, *arrays, p["block"], p["format"].bits))
        return outs

    def xla_dequantizing(xs, quantized):
        return [
            block_products_xla(xs[p["shape"][1]], *arrays, p["block"], p["format"].bits)
            for p, weights in zip(parts, quantized, strict=True)
            for arrays in weights
        ]

    def row_kernel(xs, dense):
        pairs = zip(parts, dense, strict=True)
        return [row_products_cpu(xs[p["shape"][1]], w) for p, ws in pairs for w in ws]

    def xla(xs, dense):
        pairs = zip(parts, dense, strict=True)
        return [row_products_xla(xs[p["shape"][1]], w) for p, ws in pairs for w in ws]

    quantized = [p["q"] for p in parts]
    dense = [p["f32"] for p in parts]
    programs = {
        "block kernel": (jax.jit(block_kernel), quantized),
        "int8 rows kernel": (jax.jit(int8_rows_kernel), [p["interleaved"] for p in parts]),
        "XLA dequantizing": (jax.jit(xla_dequantizing), quantized),
    }
    if all(row_products_cpu_takes(xs[w], parts[0]["f32"][0][:, :w], jnp.float32) for w in widths):
        programs["float32 row kernel"] = (jax.jit(row_kernel), dense)
    programs["XLA float32"] = (jax.jit(xla), dense)
    return xs, programs


def _case(name, parts, rows, rounds):
    xs, programs = _programs(parts, rows)
    outputs = {m: f(xs, w) for m, (f, w) in programs.items()}  # compiles; untimed
    jax.block_until_ready(outputs)
    differences = {
        method: max(
            float(jnp.abs(a - b).max() / jnp.abs(b).max())
            for a, b in zip(outputs[method], outputs["XLA float32"], strict=True)
        )
        for method in ("block kernel", "int8 rows kernel")
    }
    del outputs
    ms = {m: [] for m in programs}
    cpu_ms = {m: [] for m in programs}
    for _ in range(rounds):
        for m, (f, w) in programs.items():
            started, cpu = time.perf_counter(), time.process_time()
            jax.block_until_ready(f(xs, w))
            ms[m].append((time.perf_counter() - started) * 1e3)
            cpu_ms[m].append((time.process_time() - cpu) * 1e3)
    weight_bytes = sum(
        sum(a.nbytes for arrays in p["q"] for a in arrays if a is not None) for p in parts
    )
    return {
        "name": name,
        "rows": rows,
        "products": sum(len(p["q"]) for p in parts),
        "quantized_bytes": weight_bytes,
        "float32_bytes": sum(sum(w.nbytes for w in p["f32"]) for p in parts),
        "max_relative_difference": differences["block kernel"],
        "int8_rows_difference": differences["int8 rows kernel"],
        "ms": ms,
        "cpu_ms": cpu_ms,
    }


def _markdown(raw) -> str:
    lines = [
        "## Block products: float32 rows times 4- and 8-bit weight blocks on a CPU "
        "(SmolLM2-135M shapes)",
        "",
        f"Measured {raw['date']} on {raw['machine']}; load average {raw['load_before']:.1f} "
        f"before the run and {raw['load_after']:.1f} after: **measured under load** (other "
        "work shared the 2 cores, so a call's threads waited their turn and wall-clock times "
        "are several times its CPU time). Compare the methods within a row, measured side by "
        "side, by their CPU time (the process's, all threads), which the waiting does not "
        f"count. Command: `.venv/bin/python {raw['command']}`. Each row is one compiled "
        "program: a shape's products for all 30 layers, each layer its own weight (so the "
        "weights stream from memory, as in a step), the LM head alone, or every projection of "
        "a step (the number of products in brackets); Q4_1 layers and a Q8_0 head (the SmolLM2 "
        "Q4_1 file's formats), random. Methods: the block kernel (pallas_kernels/"
        "block_products/cpu.py), XLA dequantizing the blocks in the program then multiplying "
        "(block_products_xla, the fallback), and on the same weights dequantized ahead to "
        "float32 the row-products kernel (at most 32 rows) and XLA's product. Milliseconds per "
        "program, median (min-max) over the timed calls after one untimed call, the methods "
        "alternating; speed-up: the other method's median CPU time over the block kernel's.",
        "",
        "| products | rows | block kernel: CPU ms / wall ms | XLA dequantizing | "
        "float32 row kernel | XLA float32 | vs XLA dequantizing / row kernel / XLA float32 "
        "| weight MB, blocks / float32 | max difference / max |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    int8_lines = [
        "",
        'Int8 rows (`weights="stored-int8-rows"`): the same weights interleaved, the rows '
        "rounded to int8 per block of 32 (cpp_kernels/int8_rows.cc), against the block "
        "kernel's float32 rows in the same rounds. Difference: the largest against XLA's "
        "float32 product over its largest output: the rows' rounding.",
        "",
        "| products | rows | block kernel CPU ms | int8 rows kernel CPU ms / wall ms | "
        "int8 rows speed-up | max difference / max |",
        "|---|---|---|---|---|---|",
    ]
    for r in raw["results"]:
        cell, ratio = _cell(r), _ratio(r)
        lines.append(
            f"| {r['name']} ({r['products']}) | {r['rows']} | {cell('block kernel')} | "
            f"{cell('XLA dequantizing')} | {cell('float32 row kernel')} | "
            f"{cell('XLA float32')} | {ratio('XLA dequantizing')} / "
            f"{ratio('float32 row kernel')} / **{ratio('XLA float32')}** | "
            f"{r['quantized_bytes'] / 1e6:.1f} / {r['float32_bytes'] / 1e6:.0f} | "
            f"{r['max_relative_difference']:.1e} |"
        )
        if "int8 rows kernel" in r["cpu_ms"]:
            block, rows = (statistics.median(r["cpu_ms"][m]) for m in METHODS[:2])
            int8_lines.append(
                f"| {r['name']} ({r['products']}) | {r['rows']} | "
                f"{median_spread(r['cpu_ms']['block kernel'])} | {cell('int8 rows kernel')} | "
                f"**{block / rows:.2f}x** | {r['int8_rows_difference']:.1e} |"
            )
    return "\n".join(lines + int8_lines) + "\n"


def _cell(result):
    cpu, wall = result["cpu_ms"], result["ms"]

    def cell(method):
        if method not in cpu:
            return "-"
        return f"{median_spread(cpu[method])} / {statistics.median(wall[method]):.3g}"

    return cell


def _ratio(result):
    cpu = result["cpu_ms"]
    block = statistics.median(cpu["block kernel"])

    def ratio(method):
        return f"{statistics.median(cpu[method]) / block:.2f}x" if method in cpu else "-"

    return ratio


if __name__ == "__main__":
    main()
