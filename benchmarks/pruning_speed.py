"""Decode-step time at long context, dense vs entropic pruning (SmolLM2, batch 8, this CPU).

For each context, 8 sequences (Lee articles joined to that length) are prefilled once; the same
cache then runs rounds of 8 greedy decode steps dense and under each named pruning setting
(benchmarks/pruning_settings.py), alternating, the first round excluded (compilation). The
kept-block table is sized as the engine sizes it: for the largest budget in the batch. Reports
median step time, the average fraction of blocks read and the KV bytes read per generated
token. Writes the "pruning_speed" section of docs/PERF.md.

`--share G` (a list; a row of the table each) builds the `long` workload's situation: groups
of G rows ask about one document. Each group's document is prefilled once and its pages are
shared (as the prefix cache shares them), each row adds a question of its own, and dense
bursts read a group's document once for all its rows, as the engine's do (cascade attention,
etjax/attention/cascade.py). Pruned rows still select and read their own blocks.

    .venv/bin/python benchmarks/pruning_speed.py [--contexts 2048,4096,8192]
        [--settings "default;fixed 25%"] [--share 1,4]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import shlex
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from etjax.constraints.matcher import mask_words

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.perf_report import machine_line, write_section
from benchmarks.pruning_settings import SETTINGS
from etjax.attention import (
    PlanSizes,
    kept_table_width,
    padded_batch_plan,
    plan_decode,
    plan_segments,
    resolve_backend,
)
from etjax.bench.workloads import LONG_QUESTIONS
from etjax.cache.kv_cache import init_kv_cache
from etjax.calibration.signal import identity_params
from etjax.entropy.cost import CostModel
from etjax.entropy.state import initial_entropy_state
from etjax.pruning.budget import kept_block_count
from etjax.pruning.config import PruningConfig
from etjax.runtime.state import DecodeState
from etjax.runtime.steps import StepStatics, decode_steps, prefill_chunk
from etjax.sampling.sampler import initial_sampler_state
from etjax.sampling.settings import SamplerSettings, pack_sampler_params
from pallas_kernels.ragged_attention import Segment
from pallas_kernels.ragged_attention.tiles import DECODE_KV_TILE, MIN_SHARED_ROWS

BATCH, PAGE, CHUNK, STEPS, ROUNDS = 8, 16, 512, 8, 5
COMPILES = [0]


def _count_compiles(event: str, duration: float, **_: object) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        COMPILES[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compiles)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="2048,4096,8192")
    parser.add_argument("--settings", default="default;fixed 25%", help="';'-separated")
    parser.add_argument(
        "--share", default="1", help="','-separated: rows per shared document, each a row"
    )
    args = parser.parse_args()
    shares = [int(x) for x in args.share.split(",")]
    if any(g < 1 or BATCH % g for g in shares):
        parser.error(f"--share={args.share}: each must divide the batch of {BATCH}")
    names = [n.strip() for n in args.settings.split(";")]
    import etjax
    from etjax.bench.corpus import lee_articles

    model = etjax.load_model()
    cfg = model.config
    backend = resolve_backend("auto")  # the engine's kernels on this machine
    articles = lee_articles()
    cost = CostModel.for_model(cfg, PAGE)
    configs = {"dense": PruningConfig(), **{n: SETTINGS[n] for n in names}}
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        for share in shares:
            leaders = list(range(0, BATCH, share))  # each group's first row: its document's
            documents = []
            for b in leaders:
                ids, i = [], b * 29
                while len(ids) < context:
                    ids += model.tokenizer.encode(articles[i % len(articles)] + "\n\n")
                    i += 1
                documents.append(ids[:context])
            # A shared document's rows differ after it, so their queries (and pruned selections)
            # do, as the `long` workload's questions do; a question fills one page.
            questions = [
                (model.tokenizer.encode(f"\nTask {b}: {LONG_QUESTIONS[b % 3]}\n") * PAGE)[:PAGE]
                if share > 1
                else []
                for b in range(BATCH)
            ]
            length = context + len(questions[0])
            width = -(-(length + (ROUNDS + 1) * len(configs) * STEPS + 1) // PAGE)
            table, num_pages = page_tables(BATCH, share, context // PAGE, width)
            cache = init_kv_cache(cfg, num_pages, PAGE, BATCH, width)  # mass: store rows
            logits = jnp.zeros((BATCH, cfg.vocab_size), jnp.float32)
            for r in range(0, context, CHUNK):
                chunks = [document[r : r + CHUNK] for document in documents]
                cache, out = prefill_rows(model, cache, table, leaders, chunks, r)
                logits = logits.at[jnp.asarray(leaders)].set(out)
            if share > 1:
                cache, logits = prefill_rows(model, cache, table, range(BATCH), questions, context)
            state = greedy_state(cfg, table, logits, length)
            times: dict[str, list[float]] = {name: [] for name in configs}
            kept: dict[str, list[float]] = {name: [] for name in configs}
            excluded = dict.fromkeys(configs, 0)
            # Each setting carries its own budgets from one burst to its next, as a resident
            # sequence does in the engine (a dense burst would otherwise reset them to 1).
            budgets = {name: np.ones(BATCH, np.float32) for name in configs}
            for round_ in range(ROUNDS + 1):  # round 0 compiles every program
                for name, pruning in configs.items():
                    reach = -(-(np.asarray(state.lengths) + STEPS) // PAGE)
                    max_kept = 0
                    if pruning.enabled:
                        needed = kept_block_count(budgets[name], reach, pruning, xp=np)
                        max_kept = kept_table_width(backend, int(needed.max()), width)
                    state = state.replace(
                        entropy=state.entropy.replace(budget=jnp.asarray(budgets[name]))
                    )
                    compiles_before = COMPILES[0]
                    started = time.perf_counter()
                    plan = None
                    if not pruning.enabled:  # dense: each row reads its own pages (etjax/attention)
                        lengths = np.asarray(state.lengths)
                        segments = [
                            Segment(b, 1, int(n), int(n) + STEPS - 1, table[b].tolist())
                            for b, n in enumerate(lengths)
                        ]
                        if share == 1:
                            sizes = PlanSizes.decode(BATCH, table.size + 1, PAGE)
                            plan = plan_segments(segments, BATCH, sizes, backend)
                        else:  # shared documents read once per group, as the engine's bursts
                            sizes = PlanSizes.decode(
                                BATCH,
                                num_pages,
                                PAGE,
                                max_seq_pages=width,
                                pages_shared=True,
                                cascade=True,
                            )
                            plan = plan_decode(segments, BATCH, sizes, backend)
                    # The batch is the whole store: rows 0..B-1, each row's full page table.
                    pruned = dataclasses.replace(backend, pruning=pruning.shape())
                    statics = StepStatics(cfg, cost, max_kept, attention_backend=pruned)
                    state, cache, out = decode_steps(
                        model.weights,
                        cache,
                        state,
                        np.arange(BATCH, dtype=np.int32),
                        table,
                        np.zeros(BATCH, np.int32),
                        plan,
                        pruning.thresholds(),
                        statics,
                        STEPS,
                    )
                    jax.block_until_ready(out)
                    elapsed = time.perf_counter() - started
                    budgets[name] = np.asarray(state.entropy.budget)
                    # A burst that compiled (a new kept-table width) is not a steady-state step.
                    if COMPILES[0] != compiles_before:
                        excluded[name] += 1
                    elif round_:
                        times[name].append(elapsed / STEPS)
                        blocks = -(
                            -(
                                np.asarray(state.lengths)[None, :]
                                - STEPS
                                + np.arange(STEPS)[:, None]
                                + 1
                            )
                            // PAGE
                        )
                        kept[name].append(float(np.mean(np.asarray(out.kept_blocks) / blocks)))
            dense_ms = float(np.median(times["dense"]) * 1e3)
            kv_dense = cost.kv_bytes_per_key * length
            # A dense burst reads the whole key tiles of a document shared by enough rows once
            # for all of them (etjax/attention/cascade.py), the rest row by row.
            tile = DECODE_KV_TILE * PAGE
            shared = context // tile * tile if share >= MIN_SHARED_ROWS else 0
            kv_dense_read = cost.kv_bytes_per_key * (shared / share + length - shared)
            for name in names:
                ms = float(np.median(times[name]) * 1e3)
                fraction = float(np.mean(kept[name]))
                rows.append(
                    dict(
                        context=context,
                        share=share,
                        setting=name,
                        dense_ms=dense_ms,
                        dense_spread_ms=[float(t * 1e3) for t in times["dense"]],
                        pruned_ms=ms,
                        pruned_spread_ms=[float(t * 1e3) for t in times[name]],
                        speedup=dense_ms / ms,
                        bursts_excluded_for_compilation=excluded[name],
                        kept_fraction=fraction,
                        kv_mb_dense=kv_dense_read / 1e6,
                        kv_mb_pruned=kv_dense * fraction / 1e6,
                    )
                )
                print(rows[-1], flush=True)
    raw = {
        "machine": machine_line(),
        "date": str(datetime.date.today()),
        "backend": backend.name,
        "rows": rows,
    }
    lines = [
        "## Entropic attention pruning: decode-step time at long context (SmolLM2, batch 8)",
        "",
        f"Measured {raw['date']} on {raw['machine']}. Command: `.venv/bin/python "
        f"benchmarks/pruning_speed.py {shlex.join(sys.argv[1:])}`. One prefilled cache, "
        f"{ROUNDS} alternating rounds of {STEPS} greedy steps dense and per setting after a "
        "warm-up round; bursts that compiled a program (a new kept-table width) are excluded; "
        f"median step time. Attention backend: `{raw['backend']}` (the engine's choice here). "
        "Rows per document 1: eight documents. More: groups of rows share their document's "
        "pages, each row with a 16-token question after it; dense bursts read a shared "
        "document once per group (cascade attention), pruned rows read their own selections.",
        "",
        "| context | rows per document | setting | dense step ms | pruned step ms | speed-up | "
        "kept fraction | KV MB read / token, dense | pruned |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['context']} | {r.get('share', 1)} | {r['setting']} | {r['dense_ms']:.1f} | "
            f"{r['pruned_ms']:.1f} | "
            f"{r['speedup']:.2f}x | {r['kept_fraction']:.1%} | {r['kv_mb_dense']:.0f} | "
            f"{r['kv_mb_pruned']:.0f} |"
        )
    write_section("pruning_speed", "\n".join(lines), raw)
    print("\n".join(lines))


def page_tables(batch: int, share: int, document_pages: int, width: int) -> tuple[np.ndarray, int]:
    """Page tables [batch, width] and the pool's page count. One row per document
    (`share` 1): each row's pages in a run of its own. Otherwise groups of `share` rows hold
    their document's pages in common, then pages of their own; page 0 is never handed out."""
    if share == 1:
        return (1 + np.arange(batch * width)).reshape(batch, width).astype(np.int32), (
            batch * width + 1
        )
    documents = batch // share
    own = width - document_pages
    table = np.empty((batch, width), np.int32)
    for b in range(batch):
        table[b, :document_pages] = 1 + (b // share) * document_pages + np.arange(document_pages)
        table[b, document_pages:] = 1 + documents * document_pages + b * own + np.arange(own)
    return table, 1 + documents * document_pages + batch * own


def prefill_rows(model, cache, table, rows, tokens, start: int):
    """Prefill `rows`, each with its `tokens` (equally long) from position `start`, four
    rows a step; the cache and the rows' last logits [len(rows), V]."""
    rows, outs = list(rows), []
    for first in range(0, len(rows), 4):
        group = rows[first : first + 4]
        chunk = np.array(tokens[first : first + 4], np.int32)
        count, n = len(group), chunk.shape[1]
        starts = np.full(count, start, np.int32)
        plan, write_pages = padded_batch_plan(
            table[group], starts, np.full(count, n, np.int32), n, PAGE
        )
        out, cache = prefill_chunk(
            model.weights,
            cache,
            chunk.reshape(-1),
            (starts[:, None] + np.arange(n)).reshape(-1).astype(np.int32),
            write_pages,
            np.arange(count, dtype=np.int32) * n + n - 1,
            plan,
            cfg=model.config,
        )
        outs.append(out)
    return cache, jnp.concatenate(outs)


def greedy_state(cfg, table, logits, context) -> DecodeState:
    """The store of `table`'s rows [B, W], each `context` tokens long, decoding greedily
    without end from `logits` [B, V] (step_floor.py times its steps the same way)."""
    rows, vocab = table.shape[0], cfg.vocab_size
    params = pack_sampler_params([SamplerSettings()] * rows, rows)
    state = DecodeState(
        logits=logits,
        lengths=jnp.full((rows,), context, jnp.int32),
        page_table=jnp.asarray(table),
        active=jnp.ones((rows,), bool),
        num_generated=jnp.zeros((rows,), jnp.int32),
        max_new_tokens=jnp.full((rows,), 10**6, jnp.int32),
        stop_on_eos=jnp.zeros((rows,), bool),
        eos_ids=jnp.asarray([-1], jnp.int32),
        token_counts=jnp.zeros((rows, vocab), jnp.int32),
        in_prompt=jnp.zeros((rows, vocab), bool),
        logprobs=jnp.zeros((rows,), jnp.int32),
        allowed=jnp.full((rows, mask_words(vocab)), 0xFFFFFFFF, jnp.uint32),
        grammar=jnp.full((rows,), -1, jnp.int32),
        sampler=params,
        sampler_state=initial_sampler_state(params),
        entropy=initial_entropy_state(jnp.zeros((rows,)), jnp.zeros((rows,))),
        calibration=identity_params(rows),
    )
    # decode_steps donates the store, and XLA refuses one buffer donated twice: equal small
    # constants (JAX shares them between leaves) each get a buffer of their own.
    return jax.tree.map(lambda leaf: jnp.array(leaf, copy=True), state)


if __name__ == "__main__":
    main()
