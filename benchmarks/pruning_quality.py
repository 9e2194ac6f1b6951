"""Teacher-forced perplexity of long documents' last 512 tokens, pruned vs dense (SmolLM2).

Documents are consecutive Lee-corpus articles joined until they reach 2K, 4K and 8K tokens. The
prefix is prefilled densely; then the last 512 tokens are fed one at a time through the decode
path, each forward pass reading the KV blocks its entropy budget keeps (budget from the
tail-corrected entropy of the distribution that predicted the token, as in generation), and
the negative log-likelihood of each next true token is accumulated. Reports the perplexity
ratio pruned / dense and the average fraction of blocks read. Writes the "pruning_quality"
section of docs/PERF.md.

    .venv/bin/python benchmarks/pruning_quality.py [--docs 2] [--lengths 2048,4096,8192]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.perf_report import machine_line, write_section
from etjax.cache.kv_cache import init_kv_cache
from etjax.entropy.estimators import exact_entropy
from etjax.model.transformer import SparsePlan, forward, logits_from_hidden
from etjax.pruning.budget import budget_entropy, kept_block_count, kept_fraction
from etjax.pruning.config import PruningConfig
from etjax.runtime.steps import prefill_chunk

EVAL_TOKENS = 512
PAGE = 16
CHUNK = 512


@functools.partial(jax.jit, static_argnames=("cfg", "pruning", "max_kept"), donate_argnames="cache")
def _teacher_forced(weights, cache, logits, tokens, start, table, cfg, pruning, max_kept):
    # Feed tokens[:-1] from position `start`; score every token of `tokens` (the first one by
    # the prefill's logits). Returns per-token NLL, blocks read and blocks available.
    def step(carry, xs):
        cache, logits = carry
        target, position = xs
        nll = jax.nn.logsumexp(logits[0]) - logits[0, target]
        blocks = (position + PAGE) // PAGE
        if pruning.enabled:
            signal = budget_entropy(logits, exact_entropy(logits), pruning)
            kept = jnp.minimum(
                kept_block_count(kept_fraction(signal, pruning), blocks[None], pruning),
                max_kept,
            )
            plan = SparsePlan(budget_blocks=kept, pruning=pruning, max_kept=max_kept)
        else:
            kept, plan = blocks[None], None
        hidden, cache = forward(
            weights,
            cache,
            target[None, None],
            position[None, None],
            jnp.ones((1, 1), bool),
            table,
            cfg,
            plan,
        )
        return (cache, logits_from_hidden(weights, hidden[:, 0])), (nll, kept[0], blocks)

    positions = start + jnp.arange(tokens.shape[0], dtype=jnp.int32)
    (cache, _), (nll, kept, blocks) = jax.lax.scan(step, (cache, logits), (tokens, positions))
    return nll, kept, blocks, cache


def evaluate(model, tokens: list[int], pruning: PruningConfig) -> dict:
    cfg = model.config
    total = len(tokens)
    prefix = total - EVAL_TOKENS
    pages = -(-total // PAGE)
    cache = init_kv_cache(cfg, pages + 1, PAGE)
    table = jnp.arange(1, pages + 1, dtype=jnp.int32)[None]
    logits = None
    for r in range(0, prefix, CHUNK):
        piece = tokens[r : min(r + CHUNK, prefix)]
        padded = np.zeros((1, CHUNK), np.int32)
        padded[0, : len(piece)] = piece
        logits, cache = prefill_chunk(
            model.weights,
            cache,
            jnp.asarray(padded),
            jnp.asarray([r], jnp.int32),
            jnp.asarray([len(piece)], jnp.int32),
            table,
            cfg=cfg,
        )
    nll, kept, blocks, _ = _teacher_forced(
        model.weights,
        cache,
        logits,
        jnp.asarray(tokens[prefix:], jnp.int32),
        jnp.int32(prefix),
        table,
        cfg,
        pruning,
        pages,
    )
    nll, kept, blocks = (np.asarray(x, np.float64) for x in (nll, kept, blocks))
    return {
        "nll": float(nll.mean()),
        "ppl": float(np.exp(nll.mean())),
        "kept_fraction": float((kept / blocks).mean()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=2)
    parser.add_argument("--lengths", default="2048,4096,8192")
    args = parser.parse_args()

    import etjax
    from tests.conftest import lee_articles

    model = etjax.load_model()
    articles = lee_articles()
    pruned_cfg = PruningConfig(enabled=True)
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        for doc in range(args.docs):
            ids: list[int] = []
            i = doc * 37  # different starting articles per document
            while len(ids) < length:
                ids += model.tokenizer.encode(articles[i % len(articles)] + "\n\n")
                i += 1
            ids = ids[:length]
            dense = evaluate(model, ids, PruningConfig())
            pruned = evaluate(model, ids, pruned_cfg)
            rows.append(dict(length=length, doc=doc, dense=dense, pruned=pruned))
            print(rows[-1], flush=True)
    raw = {
        "machine": machine_line(),
        "date": str(datetime.date.today()),
        "pruning": pruned_cfg.__dict__,
        "rows": rows,
    }
    lines = [
        "## Entropic attention pruning: long-context perplexity (SmolLM2)",
        "",
        f"Measured {raw['date']} on {raw['machine']}. Command: `.venv/bin/python "
        f"benchmarks/pruning_quality.py --docs {args.docs} --lengths {args.lengths}`. "
        "Teacher-forced NLL of the last 512 tokens of Lee articles joined to the length, through "
        f"the decode path; pruning with the default `PruningConfig` ({pruned_cfg}).",
        "",
        "| context | doc | dense ppl | pruned ppl | ratio | kept fraction (mean) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['length']} | {r['doc']} | {r['dense']['ppl']:.3f} | {r['pruned']['ppl']:.3f} "
            f"| {r['pruned']['ppl'] / r['dense']['ppl']:.4f} | {r['pruned']['kept_fraction']:.1%} |"
        )
    write_section("pruning_quality", "\n".join(lines), raw)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
