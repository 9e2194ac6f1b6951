"""Teacher-forced perplexity of long documents through the decode path, pruned or dense.

Documents are consecutive Lee-corpus articles joined until they reach a context length. The
prefix is prefilled densely, once (all documents as one batch, `PREFILL_ROWS` rows at a time);
then the last `EVAL_TOKENS` tokens are fed one at a time through the decode path from that
cache, each forward pass reading the blocks its pruning budget keeps (the budget of a token
comes from the distribution that predicted it, as in generation), and the negative
log-likelihood of each next true token is accumulated. The ratio of pruned to dense perplexity
on the same documents is the quality cost of pruning at that length.

On a mixture-of-experts model the fed tokens can also run fewer experts where the entropy of
the distribution that predicted them is low (`ExpertSteering`, etjax/experts), as decode steps
do.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from etjax.attention import (
    XLA,
    PlanSizes,
    SparsePlan,
    kept_table_width,
    padded_batch_plan,
    plan_segments,
)
from etjax.cache.kv_cache import KVCache, init_kv_cache, token_pages
from etjax.entropy.cost import CostModel
from etjax.entropy.estimators import exact_entropy
from etjax.model.transformer import forward, logits_from_hidden
from etjax.pruning.budget import budget_entropy, kept_block_count, kept_fraction
from etjax.pruning.config import PruningConfig
from etjax.runtime.steps import prefill_chunk
from pallas_kernels.ragged_attention import Segment

EVAL_TOKENS = 512
PAGE = 16
CHUNK = 512
PREFILL_ROWS = 2


@flax.struct.dataclass
class ExpertSteering:
    """Which fed tokens run `reduced_top_k` experts instead of the model's k: those whose
    predicting distribution's entropy signal is below `entropy_threshold` (nats), as
    `ExpertConfig` decides in decode steps, and those `forced` marks (an entropy-blind
    control: tokens picked at random, whatever their entropy). Traced: settings share one
    program."""

    entropy_threshold: jax.Array  # [] float32
    reduced_top_k: jax.Array  # [] int32
    forced: jax.Array  # [T, B] bool, T the scored tokens per document

    @classmethod
    def by_entropy(cls, threshold: float, reduced_top_k: int, shape: tuple[int, int]):
        return cls(jnp.float32(threshold), jnp.int32(reduced_top_k), jnp.zeros(shape, bool))

    @classmethod
    def at_random(cls, forced: np.ndarray, reduced_top_k: int):
        return cls(jnp.float32(-1.0), jnp.int32(reduced_top_k), jnp.asarray(forced, bool))


@functools.partial(jax.jit, static_argnames=("cfg", "pruning", "max_kept"))
def _teacher_forced(
    weights, cache, logits, tokens, start, table, plan, temperature, thresholds, cfg, pruning,
    max_kept, steer,
):  # fmt: skip
    # Feed tokens[:, :-1] from position `start` [B]; score every token of `tokens` [B, T] (the
    # first by the prefill's logits). Returns per-token NLL, blocks read, blocks available and
    # experts run. `temperature` [B]: the entropy signal's calibration (etjax/calibration;
    # 1 = raw). `pruning` (its shape) is static and `thresholds` traced, as in the engine:
    # settings that differ only in their numbers (a sweep of ramps) run one compiled program.
    # `steer`: an ExpertSteering, or None (every token runs k experts).
    k = cfg.num_experts_per_tok

    def step(carry, xs):
        cache, logits = carry
        target, offset, forced = xs  # [B], scalar, [B]
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
                budget_blocks=kept, page_table=table, thresholds=thresholds, max_kept=max_kept
            )
            backend = dataclasses.replace(plan.backend, pruning=pruning)
            step_plan = plan.replace(backend=backend, sparse=sparse)
        else:
            kept, step_plan = blocks, plan
        active_k = None
        if steer is not None:
            low = (exact_entropy(logits, temperature) < steer.entropy_threshold) | forced
            active_k = jnp.where(low, steer.reduced_top_k, k).astype(jnp.int32)
        write_pages = token_pages(table, position, jnp.ones_like(position, bool), PAGE)
        hidden, cache = forward(
            weights,
            cache,
            target,
            position,
            write_pages,
            cfg,
            # Under pruning the passes serve only a sliding-window model's local layers.
            plan=step_plan,
            active_k=active_k,
        )
        ran = jnp.full_like(target, k) if active_k is None else active_k
        return (cache, logits_from_hidden(weights, hidden)), (nll, kept, blocks, ran)

    offsets = jnp.arange(tokens.shape[1], dtype=jnp.int32)
    forced = jnp.zeros(tokens.T.shape, bool) if steer is None else steer.forced
    (cache, _), outs = jax.lax.scan(step, (cache, logits), (tokens.T, offsets, forced))
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
    model,
    prefilled: Prefilled,
    pruning: PruningConfig,
    calibration_temperature: float = 1.0,
    experts: ExpertSteering | None = None,
) -> dict:
    """Perplexity of every document's last tokens under `pruning`, and the fraction of blocks
    read: {"ppl": [per document], "kept_fraction": mean over tokens and documents of the
    pruned layers' blocks, "read_fraction": of every layer's key reads against the dense
    model's (a sliding-window layer reads its window, pruned or not)}. The budgets follow the
    entropy at `calibration_temperature` (the calibrated signal; 1 = the model's own).
    With `experts` (a mixture-of-experts model), the fed tokens it picks run fewer experts;
    "experts_run" is then the fraction of the k-expert products the fed tokens ran and
    "reduced" the fraction of fed tokens that ran fewer."""
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
    nll, kept, blocks, ran = _teacher_forced(
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
        experts,
    )
    nll, kept, blocks, ran = (np.asarray(x, np.float64) for x in (nll, kept, blocks, ran))
    # [T, B] each; the last fed token predicts nothing scored, so it is not counted.
    # Key reads per token over all layers (a sliding-window layer reads at most its window).
    cost = CostModel.for_model(model.config, PAGE)
    read = cost.layer_keys(kept * PAGE, blocks * PAGE, xp=np)
    dense_read = cost.layer_keys(blocks * PAGE, xp=np)
    return {
        "ppl": np.exp(nll.mean(axis=0)).tolist(),
        "kept_fraction": float((kept / blocks).mean()),
        "read_fraction": float((read / dense_read).mean()),
        **(
            {}
            if experts is None
            else {
                "experts_run": float(ran[:-1].mean() / model.config.num_experts_per_tok),
                "reduced": float((ran[:-1] < model.config.num_experts_per_tok).mean()),
            }
        ),
    }
