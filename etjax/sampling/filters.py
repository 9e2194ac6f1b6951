"""Logit penalties and truncation filters, vectorised over rows with per-row settings.

The truncation filters are skipped at run time (`lax.cond`) when no row in the batch uses them,
so a batch of plain requests pays nothing for the selection they need.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from etjax.distributed.topk import top_k
from etjax.sampling.settings import MIROSTAT_V2, SamplerParams

_LOG2 = 0.6931471805599453


def apply_penalties(
    logits: jax.Array, p: SamplerParams, counts: jax.Array, in_prompt: jax.Array
) -> jax.Array:
    """Repetition (prompt and output), presence and frequency (output) penalties.

    logits: [B, V] float32; counts: [B, V] int32 occurrences in the output so far; in_prompt:
    [B, V] bool. Returns penalised logits [B, V].
    """
    # Elementwise and fused into one pass: cheaper to always run than to branch around, since
    # a run-time branch makes XLA:CPU copy the [B, V] operands in and out.
    seen = in_prompt | (counts > 0)
    r = p.repetition_penalty[:, None]
    z = jnp.where(seen, jnp.where(logits > 0, logits / r, logits * r), logits)
    z = z - p.presence_penalty[:, None] * (counts > 0)
    return z - p.frequency_penalty[:, None] * counts


# Top-k, top-p, min-p and Mirostat keep a prefix of the tokens sorted by probability. A full
# sort of the vocabulary costs ~100x the rest of a sampling step on CPU, so these filters work on
# the CANDIDATES most likely tokens and fall back to the full sort only when some row's prefix
# could extend past them; the result is exact either way.
CANDIDATES = 256


def truncate(x: jax.Array, p: SamplerParams, mirostat_mu: jax.Array) -> jax.Array:
    """Mask tokens outside top-k, top-p, min-p, typical-p and Mirostat's surprise bound.

    x: [B, V] temperature-scaled logits. Returns x with excluded tokens set to -inf; at least
    one token survives (the most likely one, or with typical-p the most typical one).
    """
    mirostat = p.kind == MIROSTAT_V2
    uses_prefix = (p.top_k > 0) | (p.top_p < 1) | (p.min_p > 0) | mirostat
    x = jax.lax.cond(
        jnp.any(uses_prefix), lambda: _prefix_filters(x, p, mirostat_mu, uses_prefix), lambda: x
    )
    return jax.lax.cond(jnp.any(p.typical_p < 1), lambda: _typical_filter(x, p), lambda: x)


def _prefix_filters(x: jax.Array, p: SamplerParams, mu: jax.Array, rows: jax.Array) -> jax.Array:
    b, v = x.shape
    if v <= CANDIDATES:
        return jnp.where(rows[:, None], _full_sort_filters(x, p, mu), x)
    values, index = top_k(x, CANDIDATES)
    top_k_inside = (p.top_k > 0) & (p.top_k <= CANDIDATES)
    # Normaliser of the distribution the filters see: the top-k tokens when top-k is on (they
    # are all candidates), else the whole vocabulary.
    in_top_k = (
        jnp.arange(CANDIDATES)[None, :] < jnp.where(top_k_inside, p.top_k, CANDIDATES)[:, None]
    )
    log_z = jnp.where(
        top_k_inside,
        jax.nn.logsumexp(jnp.where(in_top_k, values, -jnp.inf), axis=-1),
        jax.nn.logsumexp(x, axis=-1),
    )
    keep, probs = _prefix_keep(values, log_z, p, mu)
    surprise_last = -jnp.log(jnp.maximum(probs[:, -1], 1e-38)) / _LOG2
    exact = (
        ~rows
        | top_k_inside
        | ((p.top_p < 1) & (jnp.sum(probs, axis=-1) >= p.top_p))
        | ((p.min_p > 0) & (probs[:, -1] < p.min_p * probs[:, 0]))
        | ((p.kind == MIROSTAT_V2) & (surprise_last > mu))
    )

    def from_candidates() -> jax.Array:
        mask = jnp.zeros((b, v), bool).at[jnp.arange(b)[:, None], index].set(keep)
        return jnp.where(rows[:, None] & ~mask, -jnp.inf, x)

    def full_sort() -> jax.Array:
        return jnp.where(rows[:, None], _full_sort_filters(x, p, mu), x)

    return jax.lax.cond(jnp.all(exact), from_candidates, full_sort)


def _prefix_keep(
    values: jax.Array, log_z: jax.Array, p: SamplerParams, mu: jax.Array
) -> tuple[jax.Array, jax.Array]:
    # values: [B, K] logits sorted descending (a prefix of the vocabulary's order); log_z: [B]
    # normaliser. Filters apply in the order top-k, top-p, min-p, Mirostat, each on the
    # distribution renormalised after top-k (as transformers does). Returns (keep, probs).
    rank = jnp.arange(values.shape[-1])[None, :]
    keep = (p.top_k[:, None] == 0) | (rank < p.top_k[:, None])
    probs = jnp.where(keep, jnp.exp(values - log_z[:, None]), 0.0)
    before = _mass_ahead(probs)
    keep &= (p.top_p[:, None] >= 1) | (before < p.top_p[:, None])
    keep &= probs >= p.min_p[:, None] * probs[:, :1]
    surprise_bits = -jnp.log(jnp.maximum(probs, 1e-38)) / _LOG2
    keep &= (p.kind[:, None] != MIROSTAT_V2) | (surprise_bits <= mu[:, None])
    return keep | (rank == 0), probs


def _full_sort_filters(x: jax.Array, p: SamplerParams, mu: jax.Array) -> jax.Array:
    b, v = x.shape
    order = jnp.argsort(-x, axis=-1)
    values = jnp.take_along_axis(x, order, axis=-1)
    in_top_k = (p.top_k[:, None] == 0) | (jnp.arange(v)[None, :] < p.top_k[:, None])
    log_z = jax.nn.logsumexp(jnp.where(in_top_k, values, -jnp.inf), axis=-1)
    keep, _ = _prefix_keep(values, log_z, p, mu)
    unsorted = jnp.zeros((b, v), bool).at[jnp.arange(b)[:, None], order].set(keep)
    return jnp.where(unsorted, x, -jnp.inf)


def _typical_filter(x: jax.Array, p: SamplerParams) -> jax.Array:
    # Locally typical sampling (Meister et al. 2023): keep the tokens whose surprise is closest
    # to the entropy until they hold typical_p of the mass.
    b, v = x.shape
    log_p = jax.nn.log_softmax(x, axis=-1)
    probs = jnp.exp(log_p)
    entropy = -jnp.sum(jnp.where(probs > 0, probs * log_p, 0.0), axis=-1, keepdims=True)
    deviation = jnp.where(probs > 0, jnp.abs(-log_p - entropy), jnp.inf)
    order = jnp.argsort(deviation, axis=-1)
    sorted_p = jnp.take_along_axis(probs, order, axis=-1)
    before = _mass_ahead(sorted_p)
    keep = (p.typical_p[:, None] >= 1) | (before < p.typical_p[:, None])
    keep |= jnp.arange(v)[None, :] == 0
    unsorted = jnp.zeros((b, v), bool).at[jnp.arange(b)[:, None], order].set(keep)
    return jnp.where(unsorted, x, -jnp.inf)


def _mass_ahead(sorted_probs: jax.Array) -> jax.Array:
    # Exclusive cumulative sum: the mass strictly ahead of each token in sorted order. Shifting
    # the inclusive sum (rather than subtracting p) rounds like a sum of the tokens ahead does.
    inclusive = jnp.cumsum(sorted_probs, axis=-1)
    return jnp.concatenate([jnp.zeros_like(inclusive[:, :1]), inclusive[:, :-1]], axis=-1)
