"""Logit penalties and truncation filters, vectorised over rows with per-row settings.

Each is skipped at run time (`lax.cond`) when no row in the batch uses it, so a batch of plain
requests pays nothing for the sort the truncation filters need.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from etjax.sampling.settings import MIROSTAT_V2, SamplerParams

_LOG2 = 0.6931471805599453


def apply_penalties(
    logits: jax.Array, p: SamplerParams, counts: jax.Array, in_prompt: jax.Array
) -> jax.Array:
    """Repetition (prompt and output), presence and frequency (output) penalties.

    logits: [B, V] float32; counts: [B, V] int32 occurrences in the output so far; in_prompt:
    [B, V] bool. Returns penalised logits [B, V].
    """

    def penalise() -> jax.Array:
        seen = in_prompt | (counts > 0)
        r = p.repetition_penalty[:, None]
        z = jnp.where(seen, jnp.where(logits > 0, logits / r, logits * r), logits)
        z = z - p.presence_penalty[:, None] * (counts > 0)
        return z - p.frequency_penalty[:, None] * counts

    used = (
        jnp.any(p.repetition_penalty != 1)
        | jnp.any(p.presence_penalty != 0)
        | jnp.any(p.frequency_penalty != 0)
    )
    return jax.lax.cond(used, penalise, lambda: logits)


def truncate(x: jax.Array, p: SamplerParams, mirostat_mu: jax.Array) -> jax.Array:
    """Mask tokens outside top-k, top-p, min-p, typical-p and Mirostat's surprise bound.

    x: [B, V] temperature-scaled logits. Returns x with excluded tokens set to -inf; at least
    one token survives (the most likely one, or with typical-p the most typical one).
    """
    mirostat = p.kind == MIROSTAT_V2
    sorted_used = (
        jnp.any(p.top_k > 0) | jnp.any(p.top_p < 1) | jnp.any(p.min_p > 0) | jnp.any(mirostat)
    )
    x = jax.lax.cond(sorted_used, lambda: _sorted_filters(x, p, mirostat_mu), lambda: x)
    return jax.lax.cond(jnp.any(p.typical_p < 1), lambda: _typical_filter(x, p), lambda: x)


def _sorted_filters(x: jax.Array, p: SamplerParams, mu: jax.Array) -> jax.Array:
    # One descending sort serves top-k, top-p, min-p and Mirostat; filters apply in that order,
    # each on the distribution renormalised after the previous one (as transformers does).
    b, v = x.shape
    order = jnp.argsort(-x, axis=-1)
    s = jnp.take_along_axis(x, order, axis=-1)
    rank = jnp.arange(v)[None, :]
    keep = (p.top_k[:, None] == 0) | (rank < p.top_k[:, None])
    s = jnp.where(keep, s, -jnp.inf)
    probs = jax.nn.softmax(s, axis=-1)
    before = _mass_ahead(probs)
    keep &= (p.top_p[:, None] >= 1) | (before < p.top_p[:, None])
    keep &= probs >= p.min_p[:, None] * probs[:, :1]
    surprise_bits = -jnp.log(jnp.maximum(probs, 1e-38)) / _LOG2
    keep &= (p.kind[:, None] != MIROSTAT_V2) | (surprise_bits <= mu[:, None])
    keep |= rank == 0
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
