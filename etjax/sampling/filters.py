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
    v = x.shape[-1]
    values = _sorted_descending(x)
    in_top_k = (p.top_k[:, None] == 0) | (jnp.arange(v)[None, :] < p.top_k[:, None])
    log_z = jax.nn.logsumexp(jnp.where(in_top_k, values, -jnp.inf), axis=-1)
    keep, _ = _prefix_keep(values, log_z, p, mu)
    # Every filter keeps a prefix of the order (rank, mass ahead and surprise grow along it).
    kept = _first_in_order(x, values, jnp.sum(keep, axis=-1))
    return jnp.where(kept, x, -jnp.inf)


def _typical_filter(x: jax.Array, p: SamplerParams) -> jax.Array:
    # Locally typical sampling (Meister et al. 2023): keep the tokens whose surprise is closest
    # to the entropy until they hold typical_p of the mass; in the order of deviation (ties in
    # index order, as a stable argsort gives them), a token is kept while the mass ahead of it
    # is below typical_p.
    log_p = jax.nn.log_softmax(x, axis=-1)
    probs = jnp.exp(log_p)
    entropy = -jnp.sum(jnp.where(probs > 0, probs * log_p, 0.0), axis=-1, keepdims=True)
    deviation = jnp.where(probs > 0, jnp.abs(-log_p - entropy), jnp.inf)
    # No sort: the mass of the tokens with a smaller deviation key grows with the key, so a
    # bisection over the 2^32 keys (32 passes over the row) finds the last key reached with
    # less than typical_p ahead of it. The keys are unsigned here so that midpoints cannot
    # overflow.
    key = jax.lax.bitcast_convert_type(_order_key(deviation), jnp.uint32) ^ jnp.uint32(1 << 31)
    typical = p.typical_p[:, None]

    def mass_below(t: jax.Array) -> jax.Array:  # [B, 1] keys -> [B, 1] mass of smaller keys
        return jnp.sum(jnp.where(key < t, probs, 0.0), axis=-1, keepdims=True)

    def halve(_, bounds):
        lo, hi = bounds  # mass_below(lo) < typical_p; the answer is in [lo, hi]
        mid = lo + (hi - lo) // 2 + (hi - lo) % 2
        reached = mass_below(mid) < typical
        return jnp.where(reached, mid, lo), jnp.where(reached, hi, mid - 1)

    b = x.shape[0]
    start = (jnp.zeros((b, 1), jnp.uint32), jnp.full((b, 1), 0xFFFFFFFF, jnp.uint32))
    last, _ = jax.lax.fori_loop(0, 32, halve, start)
    # The largest key present at or below it (the smallest key always is: nothing is ahead).
    cut = jnp.max(jnp.where(key <= last, key, 0), axis=-1, keepdims=True)
    tied = key == cut
    ahead = mass_below(cut) + jnp.cumsum(jnp.where(tied, probs, 0.0), axis=-1)
    ahead -= jnp.where(tied, probs, 0.0)
    kept = (typical >= 1) | (key < cut) | (tied & (ahead < typical))
    return jnp.where(kept, x, -jnp.inf)


# Sorting on XLA:CPU: an argsort is a two-operand sort that calls a compiled comparator per
# comparison (82 ms for [8, 49152] float32, 2-core Xeon, 2026-12-05), where one int32 operand
# in its natural order takes a library sort (16 ms). Floats map to int32 keys in the same
# order (negative floats have their magnitude bits flipped), so the whole-row fallback sorts
# keys alone and finds the kept tokens by comparing with the cut-off value instead of
# permuting back (typical-p, whose order is not the logits', bisects the same keys instead).


def _order_key(x: jax.Array) -> jax.Array:
    """int32 keys ordered as the float32 values `x` are (-inf first; -0.0 just below 0.0)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def _from_order_key(key: jax.Array) -> jax.Array:
    """The float32 values of `_order_key`'s keys (the map is its own inverse on the bits)."""
    bits = jnp.where(key < 0, key ^ jnp.int32(0x7FFFFFFF), key)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _sorted_descending(x: jax.Array) -> jax.Array:
    """x [B, V] float32 sorted along the last axis, largest first: `~key` reverses int32 order
    without overflow."""
    return _from_order_key(~jax.lax.sort(~_order_key(x), dimension=1))


def _first_in_order(x: jax.Array, descending: jax.Array, n: jax.Array) -> jax.Array:
    """[B, V] bool: each row's first n[b] tokens in the order of x descending, ties in index
    order (a stable argsort of -x), given `descending` = x sorted that way. They are the tokens
    above the n-th value and, of those equal to it, the first by index that complete n."""
    cut = jnp.take_along_axis(descending, jnp.maximum(n - 1, 0)[:, None], axis=-1)
    above = x > cut
    tied = x == cut
    room = n[:, None] - jnp.sum(above, axis=-1, keepdims=True)
    return above | (tied & (jnp.cumsum(tied, axis=-1) <= room))


def _mass_ahead(sorted_probs: jax.Array) -> jax.Array:
    # Exclusive cumulative sum: the mass strictly ahead of each token in sorted order. Shifting
    # the inclusive sum (rather than subtracting p) rounds like a sum of the tokens ahead does.
    inclusive = jnp.cumsum(sorted_probs, axis=-1)
    return jnp.concatenate([jnp.zeros_like(inclusive[:, :1]), inclusive[:, :-1]], axis=-1)
