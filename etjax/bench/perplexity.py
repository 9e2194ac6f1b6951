"""Teacher-forced perplexity of long documents through the decode path, pruned or dense.

Documents are consecutive Lee-corpus articles joined until they reach a context length. The
prefix is prefilled densely, once (all documents as one batch, `PREFILL_ROWS` rows at a time);
then the last `EVAL_TOKENS` tokens are fed one at a time through the decode path from that
cache, each forward pass reading the blocks its pruning budget keeps (the budget of a token
comes from the distribution that predicted it, as in generation), and the negative
log-likelihood of each next true token is accumulated. The ratio of pruned to dense perplexity
on the same documents is the quality cost of pruning at that length.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from etjax.attention import XLA, PlanSizes, kept_table_width, padded_batch_plan, plan_segments
from etjax.cache.kv_cache import KVCache, init_kv_cache, token_pages
from etjax.entropy.cost import CostModel
from etjax.entropy.estimators import exact_entropy
from etjax.model.transformer import SparsePlan, forward, logits_from_hidden
from etjax.pruning.budget import budget_entropy, kept_block_count, kept_fraction
from etjax.pruning.config import PruningConfig
from etjax.runtime.steps import prefill_chunk
from pallas_kernels.ragged_attention import Segment

EVAL_TOKENS = 512
PAGE = 16
CHUNK = 512
PREFILL_ROWS = 2


@functools.partial(jax.jit, static_argnames=("cfg", "pruning", "max_kept"))
def _teacher_forced(
    weights, cache, logits, tokens, start, table, plan, temperature, thresholds, cfg, pruning,
    max_kept,
):  # fmt: skip
    # Feed tokens[:, :-1] from position `start` [B]; score every token of `tokens` [B, T] (the
    # first by the prefill's logits). Returns per-token NLL, blocks read and blocks available.
    # `temperature` [B]: the entropy signal's calibration (etjax/calibration; 1 = raw).
    # `pruning` (its shape) is static and `thresholds` traced, as in the engine: settings that
    # differ only in their numbers (a sweep of ramps) run one compiled program.
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
            signal = budget_entropy(
                logits, exact_entropy(logits, temperature), pruning, temperature
            )
            kept = jnp.minimum(
                kept_block_count(kept_fraction(signal, thresholds), blocks, thresholds), max_kept
            )
            sparse = SparsePlan(
                budget_blocks=kept,
                page_table=table,
                thresholds=thresholds,
                pruning=pruning,
                max_kept=max_kept,
            )
        else:
            kept, sparse = blocks, None
        write_pages = token_pages(table, position, jnp.ones_like(position, bool), PAGE)
        hidden, cache = forward(
            weights,
            cache,
            target,
            position,
            write_pages,
            cfg,
            plan=plan,  # under pruning, only a sliding-window model's local layers use it
            sparse=sparse,
        )
        return (cache, logits_from_hidden(weights, hidden)), (nll, kept, blocks)

    offsets = jnp.arange(tokens.shape[1], dtype=jnp.int32)
    (cache, _), outs = jax.lax.scan(step, (cache, logits), (tokens.T, offsets))
    return outs


def long_documents(tokenizer, articles: list[str], count: int, length: int) -> list[list[int]]:
    """`count` token sequences of exactly `length` tokens, each of consecutive articles."""
    docs = []
    for doc in range(count):
        ids: list[int] = []
        i = doc * 37  # different starting articles per document
        while len(ids) < length:
            ids += tokenizer.encode(articles[i % len(articles)] + "\n\n")
            i += 1
        docs.append(ids[:length])
    return docs


@dataclass
class Prefilled:
    """The dense prefix of every document, prefilled once and shared by every setting."""

    docs: list[list[int]]
    cache: KVCache
    logits: jax.Array  # [docs, vocab]: the prediction of each document's first scored token
    table: jax.Array  # [docs, pages] page table
    prefix: int  # tokens prefilled; the rest are scored


def prefill_documents(model, docs: list[list[int]], kv_dtype: str | None = None) -> Prefilled:
    """Prefill all but the last `EVAL_TOKENS` tokens of every document (equal lengths), into a
    cache of `kv_dtype` ("float32", "bfloat16"; None: the model's dtype)."""
    cfg = model.config
    rows, total = len(docs), len(docs[0])
    prefix = total - EVAL_TOKENS
    pages = -(-total // PAGE)
    # Block mass: row b is document b.
    cache = init_kv_cache(cfg, rows * pages + 1, PAGE, rows, pages, kv_dtype)
    table = (1 + np.arange(rows * pages)).reshape(rows, pages).astype(np.int32)
    logits = np.zeros((rows, cfg.vocab_size), np.float32)
    for first in range(0, rows, PREFILL_ROWS):
        group = list(range(first, min(first + PREFILL_ROWS, rows)))
        for r in range(0, prefix, CHUNK):
            n = min(r + CHUNK, prefix) - r
            tokens = np.array([docs[i][r : r + n] + [0] * (CHUNK - n) for i in group], np.int32)
            starts = np.full(len(group), r, np.int32)
            valid = np.full(len(group), n, np.int32)
            plan, write_pages = padded_batch_plan(
                table[group], starts, valid, CHUNK, PAGE, model.config.attention_window
            )
            positions = (starts[:, None] + np.arange(CHUNK)).reshape(-1).astype(np.int32)
            last = np.arange(len(group), dtype=np.int32) * CHUNK + n - 1
            out, cache = prefill_chunk(
                model.weights,
                cache,
                tokens.reshape(-1),
                positions,
                write_pages,
                last,
                plan,
                cfg=cfg,
            )
            logits[group] = np.asarray(out)
    return Prefilled(docs, cache, jnp.asarray(logits), jnp.asarray(table), prefix)


def perplexity(
    model, prefilled: Prefilled, pruning: PruningConfig, calibration_temperature: float = 1.0
) -> dict:
    """Perplexity of every document's last tokens under `pruning`, and the fraction of blocks
    read: {"ppl": [per document], "kept_fraction": mean over tokens and documents of the
    pruned layers' blocks, "read_fraction": of every layer's key reads against the dense
    model's (a sliding-window layer reads its window, pruned or not)}. The budgets follow the
    entropy at `calibration_temperature` (the calibrated signal; 1 = the model's own)."""
    table, prefix = prefilled.table, prefilled.prefix
    pages = table.shape[1]
    max_kept = 0
    if pruning.enabled:
        # Size the kept table for the largest budget the setting can grant, as the engine does.
        top = 1.0 if pruning.entropy_low < 99 else pruning.min_fraction
        needed = int(kept_block_count(jnp.asarray([top]), jnp.asarray([pages]), pruning)[0])
        max_kept = kept_table_width(XLA, needed, pages)
    tokens = jnp.asarray([d[prefix:] for d in prefilled.docs], jnp.int32)
    rows, scored = tokens.shape
    table_host = np.asarray(table)
    # Dense steps read each document's pages up to the last scored position.
    segments = [
        Segment(b, 1, prefix, prefix + scored - 1, table_host[b].tolist()) for b in range(rows)
    ]
    plan = plan_segments(
        segments,
        rows,
        PlanSizes.decode(rows, table_host.size + 1, PAGE),
        window=model.config.attention_window,
    )
    nll, kept, blocks = _teacher_forced(
        model.weights,
        prefilled.cache,  # not donated: every setting starts from the same prefilled cache
        prefilled.logits,
        tokens,
        jnp.full((len(prefilled.docs),), prefix, jnp.int32),
        table,
        plan,
        jnp.full((rows,), calibration_temperature, jnp.float32),
        pruning.thresholds(),
        model.config,
        pruning.shape(),
        max_kept,
    )
    nll, kept, blocks = (np.asarray(x, np.float64) for x in (nll, kept, blocks))  # [T, B]
    # Key reads per token over all layers (a sliding-window layer reads at most its window).
    cost = CostModel.for_model(model.config, PAGE)
    read = cost.layer_keys(kept * PAGE, blocks * PAGE, xp=np)
    dense_read = cost.layer_keys(blocks * PAGE, xp=np)
    return {
        "ppl": np.exp(nll.mean(axis=0)).tolist(),
        "kept_fraction": float((kept / blocks).mean()),
        "read_fraction": float((read / dense_read).mean()),
    }
