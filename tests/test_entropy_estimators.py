"""Entropy estimators against mathematical truths, on random, peaked, flat and masked logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from etjax.entropy.estimators import (
    entropy_and_varentropy,
    exact_entropy,
    masked_entropy_and_log_normaliser,
    tail_bounds,
    topk_entropy,
)
from tests.hypothesis_profiles import examples

# Float32 sums over V terms carry ~V * 6e-8 relative rounding; bounds are checked up to that.
SLACK = 2e-5

_exact = jax.jit(exact_entropy)
_bounds = jax.jit(tail_bounds, static_argnums=1)
_topk = jax.jit(topk_entropy, static_argnums=1)
_both = jax.jit(entropy_and_varentropy)
_masked = jax.jit(masked_entropy_and_log_normaliser)


def _reference_entropy(logits: np.ndarray) -> np.ndarray:
    # float64 numpy: the independent truth.
    z = logits.astype(np.float64)
    z = z - np.max(z, axis=-1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, p * np.log(p), 0.0)
    return -terms.sum(axis=-1)


@st.composite
def logit_batches(draw):
    vocab = draw(st.sampled_from([2, 3, 17, 1000, 49152, 262144]))
    rows = draw(st.integers(1, 3))
    kind = draw(st.sampled_from(["random", "peaked", "flat", "masked", "extreme"]))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    scale = draw(st.sampled_from([0.1, 1.0, 5.0]))
    z = rng.normal(0, scale, (rows, vocab)).astype(np.float32)
    if kind == "peaked":
        z[:, rng.integers(vocab)] += draw(st.sampled_from([10.0, 30.0, 80.0]))
    elif kind == "flat":
        z[:] = 0.0
    elif kind == "masked":
        keep = max(1, int(vocab * draw(st.sampled_from([0.001, 0.1, 0.9]))))
        z[:, keep:] = -np.inf
        rng.shuffle(z, axis=1)
    elif kind == "extreme":
        z *= 1e4
        z[:, 0], z[:, -1] = 3e38, -3e38  # near the float32 limits: differences overflow to inf
    k = draw(st.integers(1, min(vocab, 512)))
    return z, k


@settings(max_examples=examples(60), deadline=None)
@given(logit_batches())
def test_bounds_bracket_exact_entropy(batch):
    z, k = batch
    exact = np.asarray(_exact(z))
    lower, upper = (np.asarray(x) for x in _bounds(z, k))
    top = np.asarray(_topk(z, k))
    for values in (exact, lower, upper, top):
        assert np.all(np.isfinite(values))
    np.testing.assert_allclose(exact, _reference_entropy(z), rtol=1e-4, atol=SLACK)
    assert np.all(top <= exact + SLACK)
    assert np.all(lower <= exact + SLACK)
    assert np.all(exact <= upper + SLACK)
    assert np.all(exact <= np.log(z.shape[1]) + SLACK)
    assert np.all(exact >= 0)


@pytest.mark.parametrize("k", [1, 64])
def test_bounds_bracket_peaked_entropy_to_float32_rounding(k):
    # A confident step: one logit 15-40 above the rest of SmolLM2's vocabulary, so the tail
    # holds 1e-3 to 1e-14 of the mass. Taken as 1 - sum(top-k p), the rounding of the
    # normaliser (an ulp of the peak) lost most of a 1e-6 tail, and the upper bound fell
    # 2.5e-5 nats below the float64 entropy; summed over the tail, the bracket holds to
    # float32's rounding relative to the entropy itself.
    rng = np.random.default_rng(7)
    z = rng.normal(0, 1, (10, 49152)).astype(np.float32)
    peaks = np.repeat([15.0, 20.0, 25.0, 30.0, 40.0], 2)
    z[np.arange(10), rng.integers(49152, size=10)] += peaks
    exact = _reference_entropy(z)
    lower, upper = (np.asarray(x, np.float64) for x in _bounds(z, k))
    rounding = 1e-7 + 1e-6 * exact
    assert np.all(lower <= exact + rounding)
    assert np.all(exact <= upper + rounding)


@pytest.mark.parametrize("vocab", [5, 1000, 49152])
def test_topk_equals_exact_when_k_is_the_vocabulary(vocab):
    z = np.random.default_rng(vocab).normal(0, 3, (4, vocab)).astype(np.float32)
    exact = np.asarray(_exact(z))
    np.testing.assert_allclose(np.asarray(_topk(z, vocab)), exact, rtol=1e-5, atol=1e-6)
    lower, upper = _bounds(z, vocab)
    np.testing.assert_allclose(np.asarray(lower), exact, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(upper), exact, rtol=1e-5, atol=1e-6)


def test_hand_computed_values():
    # Uniform over 4: H = log 4, varentropy 0. Two tokens with p = (0.75, 0.25):
    # H = -(0.75 ln 0.75 + 0.25 ln 0.25); Var = sum p (ln p + H)^2.
    uniform = np.zeros((1, 4), np.float32)
    h, v = _both(uniform)
    assert float(h[0]) == pytest.approx(np.log(4), rel=1e-6)
    assert float(v[0]) == pytest.approx(0.0, abs=1e-6)
    z = np.log(np.array([[0.75, 0.25]], np.float32))
    h, v = _both(z)
    expected_h = -(0.75 * np.log(0.75) + 0.25 * np.log(0.25))
    expected_v = 0.75 * (np.log(0.75) + expected_h) ** 2 + 0.25 * (np.log(0.25) + expected_h) ** 2
    assert float(h[0]) == pytest.approx(expected_h, rel=1e-6)
    assert float(v[0]) == pytest.approx(expected_v, rel=1e-5)
    # Top-1 of (0.5, 0.25, 0.25): head = 0.5 ln 2; tail mass 0.5, p_k = 0.5.
    z = np.log(np.array([[0.5, 0.25, 0.25]], np.float32))
    lower, upper = _bounds(z, 1)
    assert float(lower[0]) == pytest.approx(0.5 * np.log(2) + 0.5 * np.log(2), rel=1e-5)
    assert float(upper[0]) == pytest.approx(0.5 * np.log(2) - 0.5 * np.log(0.5 / 2), rel=1e-5)


def test_varentropy_is_the_slope_of_entropy_in_log_temperature():
    # dH/dlog T = Var[-log p_T]: check against a central finite difference.
    z = np.random.default_rng(0).normal(0, 2, (3, 500)).astype(np.float64)
    u, eps = 0.3, 1e-4

    def entropy_at(log_t: float) -> np.ndarray:
        return _reference_entropy(z / np.exp(log_t))

    slope = (entropy_at(u + eps) - entropy_at(u - eps)) / (2 * eps)
    _, varentropy = _both(jnp.asarray(z / np.exp(u), jnp.float32))
    np.testing.assert_allclose(np.asarray(varentropy), slope, rtol=1e-3)


def test_all_masked_row_is_finite():
    z = np.full((2, 10), -np.inf, np.float32)
    z[1, 3] = 0.0
    for value in (_exact(z), *_bounds(z, 3), _topk(z, 3), *_both(z)):
        assert np.all(np.isfinite(np.asarray(value)))
    assert float(_exact(z)[1]) == 0.0


def test_masked_and_full_entropy_by_hand():
    # p = (1/2, 1/4, 1/8, 1/8) allowing tokens 0 and 2: renormalised (0.8, 0.2) over a mass
    # of 5/8; the full distribution's H = 1/2 ln 2 + 1/4 ln 4 + 2/8 ln 8 = 1.75 ln 2.
    z = np.log(np.array([[0.5, 0.25, 0.125, 0.125]] * 3, np.float32))
    allowed = np.array([[1, 0, 1, 0], [0, 0, 0, 1], [1, 1, 1, 1]], bool)
    masked, log_normaliser, full = (np.asarray(x) for x in _masked(z, allowed))
    assert masked[0] == pytest.approx(-(0.8 * np.log(0.8) + 0.2 * np.log(0.2)), rel=1e-6)
    assert log_normaliser[0] == pytest.approx(np.log(0.625), rel=1e-6)
    np.testing.assert_allclose(full, 1.75 * np.log(2), rtol=1e-6)
    # One token allowed (a forced step): no entropy, exactly; its log-probability 0.
    assert masked[1] == 0.0 and log_normaliser[1] == pytest.approx(np.log(0.125), rel=1e-6)
    # Everything allowed: one distribution, the same value bit for bit, `exact_entropy`'s.
    assert masked[2] == full[2] and log_normaliser[2] == pytest.approx(0.0, abs=1e-6)
    assert full[2] == pytest.approx(float(_exact(z)[2]), rel=1e-6)


@pytest.mark.parametrize("vocab", [1000, 49152])
def test_masked_and_full_entropy_match_float64(vocab):
    # Masks sparse and dense, the allowed tokens far below the overall maximum (80 nats: one
    # shift for all would underflow them), and a row allowing nothing.
    rng = np.random.default_rng(vocab)
    z = rng.normal(0, 5, (5, vocab)).astype(np.float32)
    allowed = rng.random((5, vocab)) < np.array([[0.001], [0.5], [0.5], [1.0], [0.0]])
    allowed[0, 0] = True
    z[2] = np.where(allowed[2], z[2] - 80.0, z[2])
    masked, log_normaliser, full = (np.asarray(x) for x in _masked(z, allowed))
    np.testing.assert_allclose(full, _reference_entropy(z), rtol=1e-5, atol=SLACK)
    z64 = np.where(allowed, z.astype(np.float64), -np.inf)
    live = allowed.any(axis=1)
    np.testing.assert_allclose(masked[live], _reference_entropy(z64[live]), rtol=1e-5, atol=SLACK)
    peak = z64[live].max(axis=1)
    reference = peak + np.log(np.exp(z64[live] - peak[:, None]).sum(axis=1))
    np.testing.assert_allclose(log_normaliser[live], reference, rtol=1e-6)
    assert masked[4] == 0.0 and np.all(np.isfinite(log_normaliser))
