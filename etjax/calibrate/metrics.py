"""How well a model's next-token probabilities match the tokens that follow, on real text.

Per scored position (logits z, the true next token y, a temperature T):
  surprisal  s = -log softmax(z / T)[y]        (its mean is the NLL, nats)
  entropy    H = -sum p log p of softmax(z / T) (the signal the engine reads)
  confidence c = max softmax(z / T), correct = [argmax z == y]
A calibrated model has E[s | H] = H (its entropy is its expected surprisal) and
P(correct | c) = c; `expected_calibration_error` and `entropy_gap` measure how far off it is.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np

ECE_BINS = 15


@functools.partial(jax.jit, static_argnames="chunk")
def token_statistics(
    logits: jax.Array, targets: jax.Array, temperature: jax.Array, chunk: int = 256
) -> dict[str, jax.Array]:
    """Surprisal, entropy, top-token confidence and correctness of each position, [N] each.

    logits: [N, V]; targets: [N] int32; temperature: scalar float32. Rows are processed
    `chunk` at a time, so the [N, V] intermediates of the softmax never coexist.
    """
    n, v = logits.shape
    pad = (-n) % chunk
    z = jnp.pad(logits.astype(jnp.float32), ((0, pad), (0, 0))).reshape(-1, chunk, v)
    y = jnp.pad(targets, (0, pad)).reshape(-1, chunk)

    def one(args):
        zc, yc = args
        x = zc / temperature
        log_p = jax.nn.log_softmax(x, axis=-1)
        p = jnp.exp(log_p)
        surprisal = -jnp.take_along_axis(log_p, yc[:, None], axis=1)[:, 0]
        entropy = -jnp.sum(jnp.where(p > 0, p * log_p, 0.0), axis=-1)
        best = jnp.argmax(zc, axis=-1)
        return surprisal, entropy, jnp.max(p, axis=-1), best == yc

    out = jax.lax.map(one, (z, y))
    names = ("surprisal", "entropy", "confidence", "correct")
    return {k: a.reshape(-1)[:n] for k, a in zip(names, out, strict=True)}


def expected_calibration_error(
    confidence: np.ndarray, correct: np.ndarray, bins: int = ECE_BINS
) -> float:
    """ECE of the top token: sum over `bins` equal-width confidence bins of
    (bin size / N) * |accuracy in bin - mean confidence in bin| (Guo et al., 2017).

    Bin b holds confidences in (b/bins, (b+1)/bins]; a confidence of exactly 0 falls in the first.
    confidence: [N] in [0, 1]; correct: [N] bool.
    """
    c = np.asarray(confidence, np.float64)
    ok = np.asarray(correct, np.float64)
    chex.assert_equal_shape([c, ok])
    chex.assert_rank(c, 1)
    index = np.clip(np.ceil(c * bins).astype(np.int64) - 1, 0, bins - 1)
    total = 0.0
    for b in range(bins):
        inside = index == b
        if inside.any():
            total += inside.sum() / c.size * abs(ok[inside].mean() - c[inside].mean())
    return float(total)


def entropy_gap(entropy: np.ndarray, surprisal: np.ndarray, bins: int = ECE_BINS) -> dict:
    """How far the entropy is from the surprisal it predicts, nats:
    {"mean": mean(H - s) (positive: the model is less sure than it turns out to be),
     "binned": sum over `bins` equal-count bins of H of (share) * |mean H - mean s| in the
     bin, the calibration error of the entropy as a predictor of the surprisal}."""
    h = np.asarray(entropy, np.float64)
    s = np.asarray(surprisal, np.float64)
    chex.assert_equal_shape([h, s])
    order = np.argsort(h, kind="stable")
    binned = sum(
        part.size / h.size * abs(h[part].mean() - s[part].mean())
        for part in np.array_split(order, bins)
        if part.size
    )
    return {"mean": float(np.mean(h - s)), "binned": float(binned)}


def summarise(stats: dict[str, np.ndarray]) -> dict[str, float]:
    """The headline figures of `token_statistics` outputs: NLL, ECE, entropy gaps, tokens."""
    gap = entropy_gap(stats["entropy"], stats["surprisal"])
    return {
        "tokens": int(np.asarray(stats["surprisal"]).size),
        "nll": float(np.mean(stats["surprisal"])),
        "ece": expected_calibration_error(stats["confidence"], stats["correct"]),
        "entropy_gap": gap["mean"],
        "entropy_gap_binned": gap["binned"],
        "mean_entropy": float(np.mean(stats["entropy"])),
    }
