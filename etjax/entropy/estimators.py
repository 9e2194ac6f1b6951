"""Next-token entropy estimators over a batch of logits, jittable, float32 accumulation.

All take logits [B, V] (any float dtype; `-inf` marks excluded tokens) and return [B] float32
nats. Conventions: 0 log 0 = 0; a row whose logits are all `-inf` has no distribution and is
given entropy 0.

The top-k family trades the O(V) p log p pass for a top-k selection: `topk_entropy` counts only
the k most likely tokens (a lower bound), and `tail_bounds` brackets the entropy of the tail mass
m (the mass outside the top k) using only that each tail probability is at most p_k, the k-th
largest:
  packed:  -m log p_k          (as few tokens as allowed hold the mass)  <= tail entropy
  spread:  -m log(m / (V - k)) (the mass spread uniformly)              >= tail entropy
so `lower <= exact <= upper` holds for every distribution. The normaliser (the sum of the
weights) and m are still O(V) reductions, but cheaper ones than the entropy's exp-multiply-add,
and they shard across a vocabulary axis as partial reductions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from etjax.distributed.topk import top_k

_TINY = 1e-30  # keeps log() finite where a mass underflows to 0; the products vanish anyway


def _shifted(logits: jax.Array, temperature: jax.Array | None = None) -> jax.Array:
    # [B, V] -> x = (z - max z) / T in float32: the largest entry is exactly 0 and every other is
    # <= 0 or -inf. Shifting before dividing keeps huge logits and tiny temperatures from
    # overflowing, and makes every term of the entropy below non-negative.
    z = logits.astype(jnp.float32)
    peak = jnp.max(z, axis=-1, keepdims=True)
    x = z - jnp.where(jnp.isfinite(peak), peak, 0.0)
    if temperature is not None:
        x = x / temperature.astype(jnp.float32)[:, None]
    return jnp.where(jnp.isnan(x), -jnp.inf, x)


def _entropy_parts(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    # x from _shifted -> (weights e^x [B, V], their sum S [B, 1], entropy [B]).
    # H = log S - sum(e^x x) / S: both terms are >= 0 because S >= 1 and x <= 0.
    w = jnp.exp(x)
    total = jnp.sum(w, axis=-1, keepdims=True)
    safe_total = jnp.maximum(total, _TINY)
    weighted = jnp.sum(jnp.where(w > 0, w * x, 0.0), axis=-1, keepdims=True)
    entropy = jnp.log(safe_total) - weighted / safe_total
    return w, safe_total, jnp.where(total[:, 0] > 0, entropy[:, 0], 0.0)


def _log_normaliser(logits: jax.Array) -> jax.Array:
    # [B, V] -> [B, 1] float32 log-sum-exp, finite even for all -inf rows.
    z = logits.astype(jnp.float32)
    peak = jnp.max(z, axis=-1, keepdims=True)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    total = jnp.sum(jnp.exp(z - peak), axis=-1, keepdims=True)
    return peak + jnp.log(jnp.maximum(total, _TINY))


def _xlogx(p: jax.Array, log_p: jax.Array) -> jax.Array:
    return jnp.where(p > 0, p * log_p, 0.0)


def exact_entropy(logits: jax.Array, temperature: jax.Array | None = None) -> jax.Array:
    """Exact entropy H = -sum p log p of softmax(logits / T), [B, V] -> [B] (T = 1 if None)."""
    return _entropy_parts(_shifted(logits, temperature))[2]


def entropy_and_log_normaliser(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Entropy [B] and log-sum-exp [B] of the logits from one pass (for token log-probs)."""
    z = logits.astype(jnp.float32)
    peak = jnp.max(z, axis=-1)
    finite_peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    _, total, entropy = _entropy_parts(_shifted(z))
    return entropy, finite_peak + jnp.log(total[:, 0])


def masked_entropy_and_log_normaliser(
    logits: jax.Array, allowed: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """For logits [B, V] and the tokens `allowed` [B, V] bool: the entropy [B] and log-sum-exp
    [B] over the allowed tokens alone (softmax renormalised over them, as a grammar's mask
    leaves it), and the entropy [B] over all V; a constrained step needs all three.

    One exponential per token serves both distributions: each token is shifted by the maximum
    of its own set (allowed tokens by the allowed maximum m_a, the others by the overall
    maximum m), so every shifted value is <= 0 and neither sum under- or overflows. The
    allowed sums are the masked distribution's (S_a = sum e, A_a = sum e x, H = log S - A / S
    as in `exact_entropy`); the full distribution's take the allowed ones rescaled to m:
    S = S_o + c S_a, A = A_o + c (A_a - d S_a), with d = m - m_a >= 0 and c = e^-d. Where
    every token is allowed, S_o = A_o = 0 and d = 0, so the two entropies are equal bit for
    bit. A row allowing nothing has masked entropy 0 and log-sum-exp log(1e-30).
    """
    z = logits.astype(jnp.float32)
    z = jnp.where(jnp.isnan(z), -jnp.inf, z)
    peak = jnp.max(z, axis=-1, keepdims=True)
    peak_allowed = jnp.max(jnp.where(allowed, z, -jnp.inf), axis=-1, keepdims=True)
    any_allowed = jnp.isfinite(peak_allowed)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    peak_allowed = jnp.where(any_allowed, peak_allowed, 0.0)
    x = z - jnp.where(allowed, peak_allowed, peak)
    w = jnp.exp(x)
    wx = jnp.where(w > 0, w * x, 0.0)

    def total(values: jax.Array, where: jax.Array) -> jax.Array:
        return jnp.sum(jnp.where(where, values, 0.0), axis=-1, keepdims=True)

    s_allowed, a_allowed = total(w, allowed), total(wx, allowed)
    s_other, a_other = total(w, ~allowed), total(wx, ~allowed)
    d = peak - peak_allowed
    c = jnp.where(any_allowed, jnp.exp(-d), 0.0)
    s_all = s_other + c * s_allowed
    a_all = a_other + c * (a_allowed - d * s_allowed)

    def entropy(s: jax.Array, a: jax.Array) -> jax.Array:
        safe = jnp.maximum(s, _TINY)
        return jnp.where(s[:, 0] > 0, (jnp.log(safe) - a / safe)[:, 0], 0.0)

    log_normaliser = peak_allowed[:, 0] + jnp.log(jnp.maximum(s_allowed[:, 0], _TINY))
    return entropy(s_allowed, a_allowed), log_normaliser, entropy(s_all, a_all)


def entropy_and_varentropy(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Entropy and varentropy Var[-log p] (nats^2) of softmax(logits), each [B].

    The varentropy is the slope of entropy in log-temperature, dH/dlog T, which is what the
    temperature controller's gain condition is stated in (docs/STABILITY.md).
    """
    x = _shifted(logits)
    w, total, entropy = _entropy_parts(x)
    p = w / total
    centred = jnp.where(p > 0, x - jnp.log(total) + entropy[:, None], 0.0)
    return entropy, jnp.sum(p * centred * centred, axis=-1)


def topk_entropy(logits: jax.Array, k: int) -> jax.Array:
    """Entropy counted over the k most likely tokens only (normalised over all V): a lower bound."""
    top, log_z = _top_k(logits, k)
    log_p = top - log_z
    return -jnp.sum(_xlogx(jnp.exp(log_p), log_p), axis=-1)


def tail_bounds(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Lower and upper bounds on the entropy from the top-k probabilities, each [B].

    With k >= V both equal the exact entropy. The upper bound is the conservative estimate the
    pruning budget reads: it never understates uncertainty.

    The tail's mass is summed over the tail itself, not taken as 1 - sum(top-k p): on a peaked
    distribution that difference cancels, and the rounding of the normaliser (an ulp of the
    largest logit, 1e-6 at a logit of 25) could leave the tail a tenth of its mass, putting
    the upper bound 1e-5 nats below the float64 entropy. Both sums are of e^(z - max z), so
    each probability carries a rounding error relative to itself alone.
    """
    vocab = logits.shape[-1]
    z = logits.astype(jnp.float32)
    top, _ = top_k(z, min(k, vocab))  # two stages: a sharded vocabulary is not gathered
    peak = top[:, :1]
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    head_weights = jnp.exp(top - peak)
    tail_weight = _tail_weight(z, top, peak) if k < vocab else 0.0
    total = jnp.maximum(jnp.sum(head_weights, axis=-1) + tail_weight, _TINY)
    log_p = top - peak - jnp.log(total)[:, None]
    head = -jnp.sum(_xlogx(head_weights / total[:, None], log_p), axis=-1)
    if k >= vocab:
        return head, head
    tail_mass = jnp.clip(tail_weight / total, 0.0, 1.0)
    log_p_k = log_p[:, -1]  # the k-th largest probability bounds every tail probability
    lower = head - tail_mass * jnp.where(jnp.isfinite(log_p_k), log_p_k, 0.0)
    upper = head - tail_mass * (jnp.log(jnp.maximum(tail_mass, _TINY)) - jnp.log(vocab - k))
    # Rounding can still put a vanishing tail a hair outside the bracket; the packed bound
    # can never exceed the spread one, so order them explicitly.
    return jnp.minimum(lower, upper), jnp.maximum(lower, upper)


def _tail_weight(z: jax.Array, top: jax.Array, peak: jax.Array) -> jax.Array:
    # [B] sum of e^(z - peak) over the tokens outside the top k: those below the k-th largest
    # logit, and the ties with it that top_k left out (a count times one weight).
    kth = top[:, -1:]
    below = jnp.sum(jnp.where(z < kth, jnp.exp(z - peak), 0.0), axis=-1)
    ties = jnp.sum(z == kth, axis=-1) - jnp.sum(top == kth, axis=-1)
    return below + ties.astype(jnp.float32) * jnp.exp(kth[:, 0] - peak[:, 0])


def _top_k(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    # -> top-k logits [B, k'] float32 sorted descending (k' = min(k, V)), log-normaliser [B, 1].
    z = logits.astype(jnp.float32)
    top, _ = top_k(z, min(k, z.shape[-1]))  # two stages: a sharded vocabulary is not gathered
    return top, _log_normaliser(z)
