"""Quality against kept fraction: teacher-forced perplexity of long documents, pruned vs dense.

Documents are consecutive Lee-corpus articles joined until they reach each context length. The
prefix is prefilled densely, once per length (all documents as one batch); then, for every
pruning setting, the last 512 tokens are fed one at a time through the decode path from a copy
of that cache, each forward pass reading the blocks its budget keeps (the budget of a token
comes from the distribution that predicted it, as in generation), and the negative
log-likelihood of each next true token is accumulated.

The settings span the curve rather than one tuned point: fixed fractions (entropy-blind
controls), entropy ramps, per-head vs shared selection, and the remembered-mass ranking.
Reports, per setting and length, the perplexity ratio pruned / dense (mean and worst document)
and the average fraction of blocks read. Writes one "pruning_quality_<length>" section of
docs/PERF.md per length.

    .venv/bin/python benchmarks/pruning_quality.py [--docs 4] [--lengths 4096,8192]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import shlex
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.perf_report import machine_line, write_section
from benchmarks.pruning_settings import SETTINGS
from etjax.cache.kv_cache import init_kv_cache
from etjax.entropy.estimators import exact_entropy
from etjax.model.transformer import SparsePlan, forward, logits_from_hidden
from etjax.pruning.budget import budget_entropy, kept_block_count, kept_fraction
from etjax.pruning.config import PruningConfig
from etjax.runtime.buckets import kept_bucket
from etjax.runtime.steps import prefill_chunk

EVAL_TOKENS = 512
PAGE = 16
CHUNK = 512
PREFILL_ROWS = 2


@functools.partial(jax.jit, static_argnames=("cfg", "pruning", "max_kept"))
def _teacher_forced(weights, cache, logits, tokens, start, table, cfg, pruning, max_kept):
    # Feed tokens[:, :-1] from position `start` [B]; score every token of `tokens` [B, T] (the
    # first by the prefill's logits). Returns per-token NLL, blocks read and blocks available.
    def step(carry, xs):
        cache, logits = carry
        target, offset = xs  # [B], scalar
        position = start + offset
        nll = (
            jax.nn.logsumexp(logits, axis=-1)
            - jnp.take_along_axis(logits, target[:, None], axis=1)[:, 0]
        )
        blocks = (position + PAGE) // PAGE
        if pruning.enabled:
            signal = budget_entropy(logits, exact_entropy(logits), pruning)
            kept = jnp.minimum(
                kept_block_count(kept_fraction(signal, pruning), blocks, pruning), max_kept
            )
            plan = SparsePlan(budget_blocks=kept, pruning=pruning, max_kept=max_kept)
        else:
            kept, plan = blocks, None
        rows = target.shape[0]
        hidden, cache = forward(
            weights,
            cache,
            target[:, None],
            position[:, None],
            jnp.ones((rows, 1), bool),
            table,
            cfg,
            plan,
        )
        return (cache, logits_from_hidden(weights, hidden[:, 0])), (nll, kept, blocks)

    offsets = jnp.arange(tokens.shape[1], dtype=jnp.int32)
    (cache, _), outs = jax.lax.scan(step, (cache, logits), (tokens.T, offsets))
    return outs


def _prefill(model, docs: list[list[int]]):
    cfg = model.config
    rows, total = len(docs), len(docs[0])
    prefix = total - EVAL_TOKENS
    pages = -(-total // PAGE)
    cache = init_kv_cache(cfg, rows * pages + 1, PAGE)
    table = (1 + np.arange(rows * pages)).reshape(rows, pages).astype(np.int32)
    logits = np.zeros((rows, cfg.vocab_size), np.float32)
    for first in range(0, rows, PREFILL_ROWS):
        group = list(range(first, min(first + PREFILL_ROWS, rows)))
        for r in range(0, prefix, CHUNK):
            n = min(r + CHUNK, prefix) - r
            tokens = np.array([docs[i][r : r + n] + [0] * (CHUNK - n) for i in group], np.int32)
            out, cache = prefill_chunk(
                model.weights,
                cache,
                jnp.asarray(tokens),
                jnp.full((len(group),), r, jnp.int32),
                jnp.full((len(group),), n, jnp.int32),
                jnp.asarray(table[group]),
                cfg=cfg,
            )
            logits[group] = np.asarray(out)
    return cache, jnp.asarray(logits), jnp.asarray(table), prefix


def evaluate(model, cache, logits, table, prefix, docs, pruning: PruningConfig) -> dict:
    """Teacher-forced NLL of every document's last tokens under `pruning`."""
    pages = table.shape[1]
    max_kept = 0
    if pruning.enabled:
        # Size the kept table for the largest budget the setting can grant, as the engine does.
        top = 1.0 if pruning.entropy_low < 99 else pruning.min_fraction
        needed = int(kept_block_count(jnp.asarray([top]), jnp.asarray([pages]), pruning)[0])
        max_kept = kept_bucket(needed, pages)
    tokens = jnp.asarray([d[prefix:] for d in docs], jnp.int32)
    nll, kept, blocks = _teacher_forced(
        model.weights,
        cache,  # not donated: every setting starts from the same prefilled cache
        logits,
        tokens,
        jnp.full((len(docs),), prefix, jnp.int32),
        table,
        model.config,
        pruning,
        max_kept,
    )
    nll, kept, blocks = (np.asarray(x, np.float64) for x in (nll, kept, blocks))  # [T, B]
    return {
        "ppl": np.exp(nll.mean(axis=0)).tolist(),
        "kept_fraction": float((kept / blocks).mean()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=4)
    parser.add_argument("--lengths", default="4096,8192")
    parser.add_argument(
        "--settings", default=";".join(n for n in SETTINGS if n != "default"), help="';'-separated"
    )
    parser.add_argument(
        "--part", default="", help="suffix of the PERF.md section, to keep several runs"
    )
    args = parser.parse_args()

    import etjax
    from tests.conftest import lee_articles

    model = etjax.load_model()
    articles = lee_articles()
    chosen = [s.strip() for s in args.settings.split(";")]
    for length in (int(x) for x in args.lengths.split(",")):
        docs = []
        for doc in range(args.docs):
            ids: list[int] = []
            i = doc * 37  # different starting articles per document
            while len(ids) < length:
                ids += model.tokenizer.encode(articles[i % len(articles)] + "\n\n")
                i += 1
            docs.append(ids[:length])
        cache, logits, table, prefix = _prefill(model, docs)
        dense = evaluate(model, cache, logits, table, prefix, docs, PruningConfig())
        results = {"dense": dense}
        print(length, "dense", dense, flush=True)
        for name in chosen:
            row = evaluate(model, cache, logits, table, prefix, docs, SETTINGS[name])
            row["ratio"] = (np.array(row["ppl"]) / np.array(dense["ppl"])).tolist()
            results[name] = row
            print(length, name, row, flush=True)
        _report(length, results, chosen, args.docs, args.part)


def _report(length: int, results: dict, chosen: list[str], num_docs: int, part: str) -> None:
    raw = {
        "machine": machine_line(),
        "date": str(datetime.date.today()),
        "settings": {n: dataclasses.asdict(SETTINGS[n]) for n in chosen},
        "results": results,
    }
    dense = ", ".join(f"{p:.2f}" for p in results["dense"]["ppl"])
    lines = [
        f"## Entropic attention pruning: quality against kept fraction, {length} tokens "
        f"(SmolLM2){', part ' + part if part else ''}",
        "",
        f"Measured {raw['date']} on {raw['machine']}. Command: `.venv/bin/python "
        f"benchmarks/pruning_quality.py {shlex.join(sys.argv[1:])}`. Teacher-forced perplexity "
        f"of the last {EVAL_TOKENS} tokens of {num_docs} documents (Lee articles joined to "
        f"{length} tokens; dense perplexities {dense}) through the decode path, pruned over "
        "dense; kept = average fraction of blocks read. Unless named, settings share the "
        "selection across KV heads, rank by the key bound only and follow the exact entropy.",
        "",
        "| setting | ppl ratio, mean | worst document | kept |",
        "|---|---|---|---|",
    ]
    for name in chosen:
        r = results[name]
        lines.append(
            f"| {name} | {np.mean(r['ratio']):.4f} | {max(r['ratio']):.4f} | "
            f"{r['kept_fraction']:.1%} |"
        )
    write_section(f"pruning_quality_{length}{part}", "\n".join(lines), raw)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
