"""Time block-sparse decode attention against dense, and dense ragged attention, on the device.

For each context length, batch size and kept fraction, builds a random paged cache (SmolLM2's
attention shape: 9 query heads, 3 KV heads, head_dim 64; page size 16; bfloat16) and times the
device's kernel keeping that fraction of blocks, against the same kernel keeping every block
(dense) and the XLA gather path (dense). Medians of 20 warm calls, `block_until_ready` before
each clock read. Writes the "kernel_timing_<backend>" section of docs/PERF.md with the device,
JAX version and date.

On a GPU (and in the CPU smoke run) it also times dense ragged attention, the engine's path:
the Pallas GPU kernel against the XLA backend on the same plan (etjax/attention/plan.py's
tiling), for decode rows at long contexts and one prefill chunk after a cached prefix, checks
both against the float32 reference, and writes the "ragged_timing_<backend>" section. It exits
non-zero (after writing) when an error is above tolerance.

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
from etjax.attention.plan import PlanSizes, plan_segments
from pallas_kernels.block_sparse import block_sparse_attention_xla
from pallas_kernels.block_sparse.pallas_gpu import block_sparse_attention_gpu
from pallas_kernels.block_sparse.pallas_tpu import block_sparse_attention_tpu
from pallas_kernels.ragged_attention import (
    Segment,
    ragged_attention_reference,
    ragged_attention_xla,
)
from pallas_kernels.ragged_attention.pallas_gpu import ragged_attention_gpu

HEADS, KV_HEADS, HEAD_DIM, PAGE = 9, 3, 64, 16
# Max |error| relative to max |reference| for bfloat16 inputs: the output is rounded to
# bfloat16 (2^-9) and the GPU kernel rounds softmax weights to bfloat16 before the values' dot.
RAGGED_TOLERANCE = 2e-2


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


def _ragged_case(rows: int, cached: int, new: int, rng: np.random.Generator):
    """`rows` sequences of `cached` tokens plus `new` tokens each, planned as the engine plans
    them; returns the inputs of both backends and of the reference."""
    width = -(-(cached + new) // PAGE)
    num_pages = 1 + rows * width
    segments = [
        Segment(r * new, new, cached, cached + new - 1, list(1 + r * width + np.arange(width)))
        for r in range(rows)
    ]
    if new == 1:
        sizes = PlanSizes.decode(rows, num_pages, PAGE)
    else:
        sizes = PlanSizes.prefill(rows * new, rows, width, PAGE)
    plan = plan_segments(segments, rows * new, sizes)
    q = jnp.asarray(rng.normal(size=(rows * new, HEADS, HEAD_DIM)), jnp.bfloat16)
    k = jnp.asarray(rng.normal(size=(num_pages, KV_HEADS, PAGE, HEAD_DIM)), jnp.bfloat16)
    v = jnp.asarray(rng.normal(size=(num_pages, KV_HEADS, PAGE, HEAD_DIM)), jnp.bfloat16)
    positions = jnp.asarray(np.tile(cached + np.arange(new), rows), jnp.int32)
    token_seq = jnp.asarray(np.repeat(np.arange(rows), new), jnp.int32)
    table = jnp.asarray((1 + np.arange(rows * width)).reshape(rows, width), jnp.int32)
    args = (q, k, v, positions, jax.device_put(plan.passes))
    return args, plan.chunk, (q, k, v, positions, token_seq, table)


def _ragged_rows(smoke: bool, interpret: bool, repeats: int) -> list[dict]:
    """Time the Pallas GPU kernel and the XLA backend on decode rows and one prefill chunk."""
    if smoke:
        cases = [(2, 255, 1), (1, 64, 64)]
    else:
        decode = [(b, c - 1, 1) for c in (4096, 8192, 16384, 32768) for b in (8, 32)]
        cases = [*decode, (1, 3584, 512)]
    reference = jax.jit(ragged_attention_reference)
    xla = jax.jit(ragged_attention_xla, static_argnames="chunk")
    rng = np.random.default_rng(1)
    rows = []
    for batch, cached, new in cases:
        args, chunk, ref_args = _ragged_case(batch, cached, new, rng)
        kernel = functools.partial(ragged_attention_gpu, chunk=chunk, interpret=interpret)
        baseline = functools.partial(xla, chunk=chunk)
        truth = np.asarray(reference(*ref_args))
        errors = [
            float(np.max(np.abs(np.asarray(fn(*args), np.float32) - truth)) / np.max(np.abs(truth)))
            for fn in (kernel, baseline)
        ]
        ms, xla_ms = _median_ms(kernel, args, repeats), _median_ms(baseline, args, repeats)
        rows.append(
            dict(
                case="decode" if new == 1 else "prefill",
                rows=batch,
                new=new,
                context=cached + new,
                ms=ms,
                xla_ms=xla_ms,
                speedup=xla_ms / ms,
                error=errors[0],
                xla_error=errors[1],
            )
        )
        print(rows[-1], flush=True)
    return rows


def _ragged_lines(rows: list[dict], device: str, backend: str, raw: dict) -> list[str]:
    interpret = raw["interpret"]
    lines = [
        f"## Dense ragged attention: Pallas GPU kernel vs XLA on {device} ({backend})",
        "",
        f"Measured {raw['date']} on {raw['machine']}, device {device}"
        f"{' (interpret mode: timings meaningless, smoke test only)' if interpret else ''}. "
        "Command: `benchmarks/gpu_check.sh` (or `.venv/bin/python benchmarks/kernel_timing.py`). "
        "SmolLM2 attention shape, page 16, bfloat16, one layer, the engine's plan "
        "(etjax/attention/plan.py), median of warm calls; errors are max |out - reference| / "
        f"max |reference| (tolerance {RAGGED_TOLERANCE}).",
        "",
        "| case | rows | new tokens | context | kernel ms | XLA ms | speed-up vs XLA | "
        "kernel error | XLA error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['rows']} | {r['new']} | {r['context']} | {r['ms']:.3f} | "
            f"{r['xla_ms']:.3f} | {r['speedup']:.2f}x | {r['error']:.1e} | {r['xla_error']:.1e} |"
        )
    return lines


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
    sections = [(name, lines, raw)]
    ragged = []
    if backend in ("gpu", "cpu"):  # the ragged kernel is Triton's; a TPU has none yet
        ragged = _ragged_rows(args.smoke, interpret, repeats)
        ragged_raw = {**raw, "rows": ragged}
        ragged_name = f"ragged_timing_{backend}" + ("_smoke" if args.smoke else "")
        sections.append((ragged_name, _ragged_lines(ragged, device, backend, raw), ragged_raw))
    for section, section_lines, section_raw in sections:
        if args.smoke:  # a check that the script runs, not a measurement: print, do not record
            print("\n".join(section_lines))
        else:
            write_section(section, "\n".join(section_lines), section_raw)
    wrong = [r for r in ragged if max(r["error"], r["xla_error"]) > RAGGED_TOLERANCE]
    if wrong:
        raise SystemExit(f"ragged attention off the reference: {wrong}")


if __name__ == "__main__":
    main()
