"""Decode-step time at long context, dense vs entropic pruning (SmolLM2, batch 8, this CPU).

For each context, 8 sequences (Lee articles joined to that length) are prefilled once; the same
cache then runs 2 x 8 decode steps dense and 2 x 8 pruned (default `PruningConfig`), alternating,
greedy. Reports median step time, the average fraction of blocks read and the KV bytes read per
generated token. Writes the "pruning_speed" section of docs/PERF.md.

    .venv/bin/python benchmarks/pruning_speed.py [--contexts 2048,4096,8192]
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.perf_report import machine_line, write_section
from etjax.cache.kv_cache import init_kv_cache
from etjax.entropy.cost import CostModel
from etjax.entropy.state import initial_entropy_state
from etjax.pruning.budget import kept_block_count
from etjax.pruning.config import PruningConfig
from etjax.runtime.buckets import kept_bucket
from etjax.runtime.state import DecodeState
from etjax.runtime.steps import decode_steps, prefill_chunk
from etjax.sampling.sampler import initial_sampler_state
from etjax.sampling.settings import SamplerSettings, pack_sampler_params

BATCH, PAGE, CHUNK, STEPS, ROUNDS = 8, 16, 512, 8, 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="2048,4096,8192")
    args = parser.parse_args()
    import etjax
    from tests.conftest import lee_articles

    model = etjax.load_model()
    cfg = model.config
    articles = lee_articles()
    cost = CostModel.for_model(cfg, PAGE)
    pruned = PruningConfig(enabled=True)
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        prompts = []
        for b in range(BATCH):
            ids, i = [], b * 29
            while len(ids) < context:
                ids += model.tokenizer.encode(articles[i % len(articles)] + "\n\n")
                i += 1
            prompts.append(ids[:context])
        width = -(-(context + ROUNDS * 2 * STEPS + 1) // PAGE)
        table = (1 + np.arange(BATCH * width)).reshape(BATCH, width).astype(np.int32)
        cache = init_kv_cache(cfg, BATCH * width + 1, PAGE)
        logits = jnp.zeros((BATCH, cfg.vocab_size), jnp.float32)
        for r in range(0, context, CHUNK):
            for start in range(0, BATCH, 4):
                rows_ = list(range(start, start + 4))
                tokens = np.array([prompts[b][r : r + CHUNK] for b in rows_], np.int32)
                out, cache = prefill_chunk(
                    model.weights,
                    cache,
                    jnp.asarray(tokens),
                    jnp.full((4,), r, jnp.int32),
                    jnp.full((4,), tokens.shape[1], jnp.int32),
                    jnp.asarray(table[rows_, : -(-(r + CHUNK) // PAGE)]),
                    cfg=cfg,
                )
                logits = logits.at[jnp.asarray(rows_)].set(out)
        state = _state(cfg, table, logits, context)
        times: dict[str, list[float]] = {"dense": [], "pruned": []}
        kept: list[float] = []
        budget = np.ones(BATCH, np.float32)
        for round_ in range(ROUNDS + 1):  # round 0 compiles both programs
            for name, pruning in (("dense", PruningConfig()), ("pruned", pruned)):
                # The kept table is sized as the engine sizes it (generate.py, _max_kept).
                reach = -(-(np.asarray(state.lengths) + STEPS) // PAGE)
                needed = int(np.asarray(kept_block_count(budget, reach, pruned)).max())
                max_kept = kept_bucket(needed, width) if pruning.enabled else 0
                started = time.perf_counter()
                state, cache, out = decode_steps(
                    model.weights, cache, state, cfg, cost, STEPS, pruning, max_kept
                )
                jax.block_until_ready(out)
                budget = np.asarray(state.entropy.budget)
                if round_:
                    times[name].append((time.perf_counter() - started) / STEPS)
                    if pruning.enabled:
                        blocks = np.asarray(state.lengths)[:, None] // PAGE
                        kept.append(float(np.mean(np.asarray(out.kept_blocks) / blocks.T)))
        dense_ms = float(np.median(times["dense"]) * 1e3)
        pruned_ms = float(np.median(times["pruned"]) * 1e3)
        kept_fraction = float(np.mean(kept))
        kv_dense = cost.kv_bytes_per_key * context
        rows.append(
            dict(
                context=context,
                dense_ms=dense_ms,
                pruned_ms=pruned_ms,
                speedup=dense_ms / pruned_ms,
                kept_fraction=kept_fraction,
                kv_mb_dense=kv_dense / 1e6,
                kv_mb_pruned=kv_dense * kept_fraction / 1e6,
            )
        )
        print(rows[-1], flush=True)
    raw = {"machine": machine_line(), "date": str(datetime.date.today()), "rows": rows}
    lines = [
        "## Entropic attention pruning: decode-step time at long context (SmolLM2, batch 8)",
        "",
        f"Measured {raw['date']} on {raw['machine']}. Command: `.venv/bin/python "
        f"benchmarks/pruning_speed.py --contexts {args.contexts}`. One prefilled cache, "
        f"{ROUNDS} alternating rounds of {STEPS} greedy steps dense and pruned (default "
        "`PruningConfig`), first round excluded (compilation), median step time.",
        "",
        "| context | dense step ms | pruned step ms | speed-up | kept fraction | "
        "KV MB read / token, dense | pruned |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['context']} | {r['dense_ms']:.1f} | {r['pruned_ms']:.1f} | "
            f"{r['speedup']:.2f}x | {r['kept_fraction']:.1%} | {r['kv_mb_dense']:.0f} | "
            f"{r['kv_mb_pruned']:.0f} |"
        )
    write_section("pruning_speed", "\n".join(lines), raw)
    print("\n".join(lines))


def _state(cfg, table, logits, context) -> DecodeState:
    rows, vocab = table.shape[0], cfg.vocab_size
    params = pack_sampler_params([SamplerSettings()] * rows, rows)
    return DecodeState(
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
        sampler=params,
        entropy=initial_entropy_state(
            initial_sampler_state(params), jnp.zeros((rows,)), jnp.zeros((rows,))
        ),
    )


if __name__ == "__main__":
    main()
