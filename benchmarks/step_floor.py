"""The decode step and the prefill chunk against their floors, on this machine (SmolLM2 or Gemma 3).

A floor is the same work written as plainly as JAX allows, with the model's own weights (same
shapes, same dtype), in one run beside etjax:

- `products`: the step's matrix products alone (each layer's norms, q|k|v, output and MLP
  products, in a Python loop over layers; the final norm, the LM head and an argmax), no
  cache and no attention: what a decode step at short context cannot go below;
- `products, row kernel`: the same products where the engine runs them on a CPU for a few
  rows, the C++ row-products kernel (etjax/model/products.py; decode rows only);
- `with attention`: the same plus a dense attention of each layer's queries over a contiguous
  cache `[B, KV heads, context, head_dim]` of the step's context (masked softmax, float32),
  the attention a paged cache should cost no more than.

etjax's figures are `decode_steps` (bursts of 8 greedy steps over a paged cache holding
`context` tokens per row, the dense plan the engine builds) and `prefill_chunk` (one
sequence's 512-token chunk after `context` cached tokens). Caches hold synthetic keys and
values (dense timing does not depend on them), so contexts the machine could not prefill in a
benchmark's time are measured too. Rounds alternate floor and etjax, the first (compiling)
excluded; each figure is the median per step, with its spread. Writes the "step_floor"
section of docs/PERF.md (`step_floor_gemma3` with `--model gemma3-270m`).

    .venv/bin/python benchmarks/step_floor.py [--batches 1,8,32] [--contexts 128,2048,8192]
        [--prefill-contexts 0,4096] [--rounds 5] [--model gemma3-270m] [--section NAME]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import shlex
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.perf_report import machine_line, median_spread, write_section
from benchmarks.pruning_speed import greedy_state
from cpp_kernels import cpu_kernels_available
from etjax.attention import PlanSizes, padded_batch_plan, plan_segments, resolve_backend
from etjax.bench.perf_doc import cpu_name
from etjax.cache.kv_cache import init_kv_cache
from etjax.engine_build import MIN_POOL_PAGES
from etjax.entropy.cost import CostModel
from etjax.model.families import family
from etjax.model.layers import rms_norm
from etjax.model.products import row_products
from etjax.model.transformer import logits_from_hidden
from etjax.runtime.steps import StepStatics, decode_steps, prefill_chunk
from etjax.sampling.sampler import first_argmax
from pallas_kernels.ragged_attention import Segment
from pallas_kernels.row_products.cpu import MAX_KERNEL_ROWS

PAGE, STEPS, CHUNK = 16, 8, 512
BURST_PAGES = (STEPS - 1) // PAGE + 2  # pages a burst of STEPS tokens can write to
# Skip a configuration whose caches (etjax's paged one and the floor's contiguous one) would
# take more than this share of the machine's memory.
MEMORY_SHARE = 0.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--contexts", default="128,2048,8192")
    parser.add_argument("--prefill-contexts", default="0,4096")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument(
        "--backends",
        default="auto,xla",
        help="attention backends of the decode rows, timed in turn (the first is the column "
        "the ratios are of; 'auto' is the engine's choice here)",
    )
    parser.add_argument("--no-write", action="store_true", help="print only; leave PERF.md")
    parser.add_argument(
        "--section",
        help="the PERF.md section to write (default: step_floor, step_floor_gemma3 for Gemma 3), "
        "so a machine of another kind keeps its own table beside the main one",
    )
    args = parser.parse_args()
    import etjax

    model = etjax.load_model(args.model, dtype="float32")
    floors = Floors(model.weights, model.config)
    backends = list(dict.fromkeys(resolve_backend(b) for b in args.backends.split(",") if b))
    rows = []
    for batch in (int(b) for b in args.batches.split(",") if b):
        for context in (int(c) for c in args.contexts.split(",") if c):
            row = _decode_row(model, floors, batch, context, args.rounds, backends)
            rows.append(row)
            print(row, flush=True)
    for context in (int(c) for c in args.prefill_contexts.split(",") if c):
        row = _prefill_row(model, floors, context, args.rounds, backends)
        rows.append(row)
        print(row, flush=True)
    raw = {
        "machine": machine_line(),
        "date": str(datetime.date.today()),
        "model": args.model,
        "command": f"benchmarks/step_floor.py {shlex.join(sys.argv[1:])}",
        "backends": [b.name for b in backends],
        "rows": rows,
    }
    name = args.section or (
        "step_floor" if args.model.startswith("smollm2") else "step_floor_gemma3"
    )
    markdown = _markdown(raw)
    if not args.no_write:
        write_section(name, markdown, raw)
    print(markdown)


class Floors:
    """The floors of a model's step, jitted once per shape."""

    def __init__(self, weights, cfg) -> None:
        self.weights, self.cfg = weights, cfg
        fam = family(cfg.architecture)
        self.qkv = functools.partial(fam.qkv_projection, cfg=cfg)
        self.rest = functools.partial(fam.output_and_mlp, cfg=cfg)
        self.products = jax.jit(self._products)
        self.row_products = jax.jit(self._products_on_kernel)
        self.decode_attention = jax.jit(self._decode_attention)
        self.prefill_attention = jax.jit(self._prefill_attention)

    def _head(self, weights, x):
        if self.cfg.architecture == "gemma3":
            from etjax.model.families.gemma3 import gemma_norm

            x = gemma_norm(x, weights.final_norm, self.cfg.rms_norm_eps)
        else:
            x = rms_norm(x, weights.final_norm, self.cfg.rms_norm_eps)
        return first_argmax(logits_from_hidden(weights, x))

    def _embed(self, weights, tokens):
        return weights.embed[tokens]

    def _products(self, weights, tokens, last):
        # tokens [T]; last: [S] the rows whose logits are taken (all of them in decode).
        cfg, x = self.cfg, self._embed(weights, tokens)
        q_width = cfg.num_heads * cfg.head_dim
        for layer in weights.layers:
            qkv = self.qkv(layer, x)
            x = self.rest(layer, x, qkv[:, :q_width])
        return self._head(weights, x[last])

    def _products_on_kernel(self, weights, tokens, last):
        with row_products(True):
            return self._products(weights, tokens, last)

    def _layer_parts(self, layer, x):
        cfg = self.cfg
        t, hd = x.shape[0], cfg.head_dim
        q_width, kv_width = cfg.num_heads * hd, cfg.num_kv_heads * hd
        qkv = self.qkv(layer, x)
        q = qkv[:, :q_width].reshape(t, cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, hd)
        return q, qkv[:, q_width : q_width + kv_width], q_width

    def _decode_attention(self, weights, tokens, keys, values, lengths):
        # One token per row; keys, values: per layer [B, KVH, S, hd]; lengths: [B] keys visible.
        x = self._embed(weights, tokens)
        visible = jnp.arange(keys[0].shape[2])[None, :] < lengths[:, None]  # [B, S]
        for layer, k, v in zip(weights.layers, keys, values, strict=True):
            q, _, q_width = self._layer_parts(layer, x)
            scores = jnp.einsum("bkgd,bksd->bkgs", q, k, preferred_element_type=jnp.float32)
            scores = jnp.where(visible[:, None, None, :], scores * q.shape[-1] ** -0.5, -1e30)
            probs = jax.nn.softmax(scores, axis=-1)
            heads = jnp.einsum("bkgs,bksd->bkgd", probs, v.astype(jnp.float32))
            x = self.rest(layer, x, heads.reshape(x.shape[0], q_width).astype(x.dtype))
        return self._head(weights, x)

    def _prefill_attention(self, weights, tokens, keys, values, start):
        # One sequence's chunk [T] from position `start`; keys, values: per layer
        # [KVH, S, hd] holding the cached context and the chunk's own keys.
        x = self._embed(weights, tokens)
        t = tokens.shape[0]
        positions = start + jnp.arange(t)
        visible = jnp.arange(keys[0].shape[1])[None, :] <= positions[:, None]  # [T, S]
        for layer, k, v in zip(weights.layers, keys, values, strict=True):
            q, _, q_width = self._layer_parts(layer, x)
            scores = jnp.einsum("tkgd,ksd->kgts", q, k, preferred_element_type=jnp.float32)
            scores = jnp.where(visible[None, None], scores * q.shape[-1] ** -0.5, -1e30)
            probs = jax.nn.softmax(scores, axis=-1)
            heads = jnp.einsum("kgts,ksd->tkgd", probs, v.astype(jnp.float32))
            x = self.rest(layer, x, heads.reshape(t, q_width).astype(x.dtype))
        return self._head(weights, x[-1:])


def _synthetic(shape, dtype, seed: int) -> jax.Array:
    # Keys and values in [-1, 1] from a cheap pattern: dense timing does not depend on them.
    @functools.partial(jax.jit, static_argnums=(0, 1))
    def fill(shape, dtype, seed):
        flat = jax.lax.iota(jnp.int32, int(np.prod(shape))) * 7919 + seed
        return ((flat % 251).astype(jnp.float32) / 125.0 - 1.0).astype(dtype).reshape(shape)

    return fill(tuple(shape), jnp.dtype(dtype), seed)


def _fits(cfg, tokens: int) -> bool:
    # Both caches (paged and contiguous) of `tokens` tokens within MEMORY_SHARE of the RAM.
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * cfg.jnp_dtype.itemsize
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return 2 * tokens * per_token <= MEMORY_SHARE * total


def _interleaved(fns: dict, rounds: int) -> dict[str, list[float]]:
    # Each function once per round, in turn; the first round (compiling) excluded.
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            started = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - started)
    return times


def _floor_times(floors: Floors, tokens, rows, kv_shape, attention, rounds: int) -> dict:
    # Seconds per call of both floors: the products of `tokens` (logits of `rows`), and
    # `attention(weights, tokens, keys, values)` over per-layer contiguous caches of `kv_shape`.
    cfg, weights = floors.cfg, floors.weights
    keys = [_synthetic(kv_shape, cfg.jnp_dtype, 2 * i) for i in range(cfg.num_layers)]
    values = [_synthetic(kv_shape, cfg.jnp_dtype, 2 * i + 1) for i in range(cfg.num_layers)]
    fns = {
        "products": lambda: floors.products(weights, tokens, rows).block_until_ready(),
        "with_attention": lambda: attention(weights, tokens, keys, values).block_until_ready(),
    }
    if tokens.shape[0] <= MAX_KERNEL_ROWS and cpu_kernels_available():
        fns["row_kernel"] = lambda: floors.row_products(weights, tokens, rows).block_until_ready()
    return _interleaved(fns, rounds)


def _decode_floors(floors: Floors, batch: int, context: int, rounds: int) -> dict:
    # One token per row over a contiguous cache of context + 1 keys.
    cfg = floors.cfg
    lengths = jnp.full((batch,), context + 1, jnp.int32)
    return _floor_times(
        floors,
        jnp.asarray(np.arange(batch) % 1000 + 100, jnp.int32),
        jnp.arange(batch),
        (batch, cfg.num_kv_heads, context + 1, cfg.head_dim),
        lambda w, t, k, v: floors.decode_attention(w, t, k, v, lengths),
        rounds,
    )


def _prefill_floors(floors: Floors, context: int, rounds: int) -> dict:
    # CHUNK tokens of one sequence after `context` cached ones.
    cfg = floors.cfg
    return _floor_times(
        floors,
        jnp.asarray(np.arange(CHUNK) % 1000 + 100, jnp.int32),
        jnp.asarray([CHUNK - 1]),
        (cfg.num_kv_heads, context + CHUNK, cfg.head_dim),
        lambda w, t, k, v: floors.prefill_attention(w, t, k, v, context),
        rounds,
    )


def _decode_row(model, floors: Floors, batch: int, context: int, rounds: int, backends) -> dict:
    cfg, weights = model.config, model.weights
    row = {"phase": "decode", "batch": batch, "context": context}
    reach = context + (rounds + 1) * STEPS * len(backends) + PAGE * BURST_PAGES
    if not _fits(cfg, batch * reach):
        return {**row, "skipped": "the caches would not fit in memory"}
    floor_times = _decode_floors(floors, batch, context, rounds)

    width = -(-reach // PAGE)
    table = (1 + np.arange(batch * width)).reshape(batch, width).astype(np.int32)
    # A pool as generate_ids sizes one: never under MIN_POOL_PAGES.
    num_pages = max(batch * width + 1, MIN_POOL_PAGES)
    cache = init_kv_cache(cfg, num_pages, PAGE)
    cache = cache.replace(
        k=_synthetic(cache.k.shape, cache.k.dtype, 1), v=_synthetic(cache.v.shape, cache.v.dtype, 2)
    )
    cost = CostModel.for_model(cfg, PAGE)
    logits = jnp.zeros((batch, cfg.vocab_size), jnp.float32)
    holder = {"state": greedy_state(cfg, table, logits, context), "cache": cache}

    def burst(backend):
        # One burst on `backend`'s kernels; the backends take turns on one cache, each burst
        # 8 positions further on.
        state = holder["state"]
        lengths = np.asarray(state.lengths)
        segments = [
            Segment(b, 1, int(n), int(n) + STEPS - 1, table[b].tolist())
            for b, n in enumerate(lengths)
        ]
        sizes = PlanSizes.decode(batch, num_pages, PAGE)
        plan = plan_segments(segments, batch, sizes, backend, window=cfg.attention_window)
        # As the engine runs a dense burst: the page table holds the pages it writes to.
        base = (lengths // PAGE).astype(np.int32)
        written = np.stack([table[b, base[b] : base[b] + BURST_PAGES] for b in range(batch)])
        state, holder["cache"], out = decode_steps(
            weights,
            holder["cache"],
            state,
            np.arange(batch, dtype=np.int32),
            written,
            base,
            plan,
            None,
            StepStatics(cfg, cost, attention_backend=backend),
            STEPS,
        )
        holder["state"] = state
        jax.block_until_ready(out)

    times = _interleaved({b.name: functools.partial(burst, b) for b in backends}, rounds)
    return {
        **row,
        "products_ms": [t * 1e3 for t in floor_times["products"]],
        "row_kernel_ms": [t * 1e3 for t in floor_times.get("row_kernel", [])],
        "with_attention_ms": [t * 1e3 for t in floor_times["with_attention"]],
        "etjax_ms": {name: [t / STEPS * 1e3 for t in ts] for name, ts in times.items()},
    }


def _prefill_row(model, floors: Floors, context: int, rounds: int, backends) -> dict:
    cfg, weights = model.config, model.weights
    row = {"phase": "prefill", "batch": 1, "context": context, "chunk": CHUNK}
    floor_times = _prefill_floors(floors, context, rounds)
    tokens = jnp.asarray(np.arange(CHUNK) % 1000 + 100, jnp.int32)

    width = -(-(context + CHUNK) // PAGE)
    table = (1 + np.arange(width))[None, :].astype(np.int32)
    cache = init_kv_cache(cfg, width + 1, PAGE)
    cache = cache.replace(
        k=_synthetic(cache.k.shape, cache.k.dtype, 1), v=_synthetic(cache.v.shape, cache.v.dtype, 2)
    )
    starts = np.asarray([context], np.int32)
    plan, write_pages = padded_batch_plan(
        table, starts, np.asarray([CHUNK], np.int32), CHUNK, PAGE, cfg.attention_window
    )
    positions = (context + np.arange(CHUNK)).astype(np.int32)
    holder = {"cache": cache}

    def chunk(backend):
        # The same positions every time: the chunk overwrites its own pages.
        logits, holder["cache"] = prefill_chunk(
            weights,
            holder["cache"],
            tokens,
            positions,
            write_pages,
            np.asarray([CHUNK - 1], np.int32),
            plan.replace(backend=backend),
            cfg=cfg,
        )
        logits.block_until_ready()

    times = _interleaved({b.name: functools.partial(chunk, b) for b in backends}, rounds)
    return {
        **row,
        "products_ms": [t * 1e3 for t in floor_times["products"]],
        "with_attention_ms": [t * 1e3 for t in floor_times["with_attention"]],
        "etjax_ms": {name: [t * 1e3 for t in ts] for name, ts in times.items()},
    }


def _markdown(raw: dict) -> str:
    backends = raw["backends"]
    first = backends[0]
    lines = [
        f"## The step against its floor: {raw['model']}, float32, on {cpu_name(raw['machine'])}",
        "",
        f"Measured {raw['date']} on {raw['machine']}. Command: `.venv/bin/python "
        f"{raw['command']}`. Floors in plain JAX with the model's weights: `products` is the "
        "step's matrix products alone (norms, projections, MLP, LM head, argmax; no cache, no "
        "attention; XLA's products, and for decode rows the C++ row-products kernel the engine "
        "runs there), `+ attention` adds a dense attention over a contiguous cache of the "
        "context. etjax: `decode_steps` bursts of 8 greedy steps over the paged cache (per "
        f"step) with each attention backend ({', '.join(backends)}: `{first}` is what the "
        "engine runs here; `cpu` is the C++ kernel, `xla` the XLA loops), and "
        "`prefill_chunk` of 512 tokens after the context, with each backend. Milliseconds, "
        "median (min-max) of the rounds after the first; the ratios "
        "are of medians.",
        "",
        "| "
        + " | ".join(
            ["phase", "batch", "context", "products ms", "products, row kernel ms"]
            + ["+ attention ms"]
            + [f"etjax {b} ms" for b in backends]
            + [f"{first} / products"]
            + [f"{b} / (+ attention)" for b in backends]
        )
        + " |",
        "|---" * (8 + 2 * len(backends) - 1) + "|",
    ]
    for r in raw["rows"]:
        head = f"| {r['phase']} | {r['batch']} | {r['context']} |"
        if "skipped" in r:
            lines.append(f"{head} skipped: {r['skipped']} |" + " |" * (2 * len(backends) + 3))
            continue
        products = float(np.median(r["products_ms"]))
        attention = float(np.median(r["with_attention_ms"]))
        times = r["etjax_ms"]
        cells = [median_spread(times[b]) if b in times else "–" for b in backends]
        ratios = [f"{np.median(times[first]) / products:.2f}x"]
        ratios += [
            f"{np.median(times[b]) / attention:.2f}x" if b in times else "–" for b in backends
        ]
        kernel = median_spread(r["row_kernel_ms"]) if r.get("row_kernel_ms") else "–"
        lines.append(
            f"{head} {median_spread(r['products_ms'])} | {kernel} "
            f"| {median_spread(r['with_attention_ms'])} "
            f"| {' | '.join(cells)} | {' | '.join(ratios)} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
