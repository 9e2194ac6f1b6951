"""Time block-sparse decode attention against dense on the current device.

For each context length, batch size and kept fraction, builds a random paged cache (SmolLM2's
attention shape: 9 query heads, 3 KV heads, head_dim 64; page size 16; bfloat16) and times the
device's kernel keeping that fraction of blocks, against the same kernel keeping every block
(dense) and the XLA gather path (dense). Medians of 20 warm calls, `block_until_ready` before
each clock read. Writes the "kernel_timing_<backend>" section of docs/PERF.md with the device,
JAX version and date.

    .venv/bin/python benchmarks/kernel_timing.py                 # on a GPU or TPU
    .venv/bin/python benchmarks/kernel_timing.py --smoke         # tiny sizes, interpret mode
"""

from __future__ import annotations

import argparse
import datetime
import functools
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.perf_report import machine_line, write_section
from pallas_kernels.block_sparse import block_sparse_attention_xla
from pallas_kernels.block_sparse.pallas_gpu import block_sparse_attention_gpu
from pallas_kernels.block_sparse.pallas_tpu import block_sparse_attention_tpu

HEADS, KV_HEADS, HEAD_DIM, PAGE = 9, 3, 64, 16


def _problem(batch: int, context: int, keep: float, rng: np.random.Generator, dtype):
    width = context // PAGE
    kept = max(1, round(width * keep))
    pages = 1 + batch * width
    q = jnp.asarray(rng.normal(size=(batch, HEADS, HEAD_DIM)), dtype)
    k = jnp.asarray(rng.normal(size=(pages, KV_HEADS, PAGE, HEAD_DIM)), dtype)
    v = jnp.asarray(rng.normal(size=(pages, KV_HEADS, PAGE, HEAD_DIM)), dtype)
    table = jnp.asarray((1 + np.arange(batch * width)).reshape(batch, width), jnp.int32)
    lengths = jnp.full((batch,), context, jnp.int32)
    # A sink, the recent window, and random blocks between: what pruning keeps.
    blocks = np.stack(
        [
            np.concatenate([[0, width - 1], rng.permutation(np.arange(1, width - 1))])[:kept]
            for _ in range(batch * KV_HEADS)
        ]
    ).reshape(batch, KV_HEADS, kept)
    counts = jnp.full((batch, KV_HEADS), kept, jnp.int32)
    all_blocks = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, KV_HEADS, width))
    dense_counts = jnp.full((batch, KV_HEADS), width, jnp.int32)
    return (q, k, v, table, jnp.asarray(blocks, jnp.int32), counts, lengths), (
        q,
        k,
        v,
        table,
        all_blocks,
        dense_counts,
        lengths,
    )


def _median_ms(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - started)
    return float(np.median(times) * 1e3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes in interpret mode")
    args = parser.parse_args()
    backend = jax.default_backend()
    interpret = args.smoke or backend == "cpu"
    kernel_fn = block_sparse_attention_tpu if backend == "tpu" else block_sparse_attention_gpu
    kernel = functools.partial(kernel_fn, interpret=interpret)
    xla = jax.jit(block_sparse_attention_xla)
    contexts = [256, 512] if args.smoke else [4096, 8192, 16384, 32768]
    batches = [2] if args.smoke else [8, 32]
    keeps = [1.0, 0.5, 0.25, 0.125]
    repeats = 2 if args.smoke else 20
    rng = np.random.default_rng(0)
    rows = []
    for context in contexts:
        for batch in batches:
            dense_ms = xla_ms = None
            for keep in keeps:
                sparse_args, dense_args = _problem(batch, context, keep, rng, jnp.bfloat16)
                ms = _median_ms(kernel, sparse_args, repeats)
                if keep == 1.0:
                    dense_ms = ms
                    xla_ms = _median_ms(xla, dense_args, repeats)
                kv_bytes = 2 * batch * KV_HEADS * sparse_args[4].shape[-1] * PAGE * HEAD_DIM * 2
                rows.append(
                    dict(
                        context=context,
                        batch=batch,
                        keep=keep,
                        ms=ms,
                        dense_ms=dense_ms,
                        xla_dense_ms=xla_ms,
                        speedup=dense_ms / ms,
                        kv_gb_s=kv_bytes / (ms * 1e-3) / 1e9,
                    )
                )
                print(rows[-1], flush=True)
    device = jax.devices()[0].device_kind
    raw = {
        "machine": machine_line(),
        "device": device,
        "date": str(datetime.date.today()),
        "interpret": interpret,
        "rows": rows,
    }
    name = f"kernel_timing_{backend}" + ("_smoke" if args.smoke else "")
    lines = [
        f"## Block-sparse decode attention kernel on {device} ({backend})",
        "",
        f"Measured {raw['date']} on {raw['machine']}, device {device}"
        f"{' (interpret mode: timings meaningless, smoke test only)' if interpret else ''}. "
        "Command: `benchmarks/gpu_check.sh` (or `.venv/bin/python benchmarks/kernel_timing.py`). "
        "SmolLM2 attention shape (9 heads, 3 KV heads, head_dim 64), page 16, bfloat16, one "
        "layer, median of warm calls.",
        "",
        "| context | batch | kept | kernel ms | kernel dense ms | speed-up vs dense | "
        "XLA dense ms | KV read GB/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['context']} | {r['batch']} | {r['keep']:.1%} | {r['ms']:.3f} | "
            f"{r['dense_ms']:.3f} | {r['speedup']:.2f}x | {r['xla_dense_ms']:.3f} | "
            f"{r['kv_gb_s']:.0f} |"
        )
    if args.smoke:  # a check that the script runs, not a measurement: print, do not record
        print("\n".join(lines))
    else:
        write_section(name, "\n".join(lines), raw)


if __name__ == "__main__":
    main()
