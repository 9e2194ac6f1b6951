"""The temperature controller against the claims proved in docs/STABILITY.md."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from etjax.entropy.controller import ControllerParams, controller_step, no_base_entropy
from etjax.entropy.estimators import exact_entropy
from tests.controller_theory import entropy_and_slope, slope_range, steps_to_converge
from tests.hypothesis_profiles import examples

_step = jax.jit(controller_step, static_argnums=4)
_entropy = jax.jit(exact_entropy)


def _params(rows: int, **values: float) -> ControllerParams:
    defaults = dict(
        target_entropy=2.0, t_min=0.3, t_max=3.0, gain=0.2, max_step=0.25, entropy_floor=0.0
    )
    defaults.update(values)
    full = lambda x: jnp.full((rows,), x, jnp.float32)  # noqa: E731
    return ControllerParams(
        target_entropy=full(defaults["target_entropy"]),
        log_t_min=full(math.log(defaults["t_min"])),
        log_t_max=full(math.log(defaults["t_max"])),
        gain=full(defaults["gain"]),
        max_step=full(defaults["max_step"]),
        entropy_floor=full(defaults["entropy_floor"]),
        track_base=jnp.full((rows,), bool(defaults.get("track_base", False))),
        log_t_base=full(math.log(defaults.get("t_base", 1.0))),
    )


def _run(z: np.ndarray, params: ControllerParams, u0: float, steps: int):
    """Apply the controller `steps` times to the same logits; returns per-step arrays."""
    logits = jnp.asarray(np.broadcast_to(z, (params.gain.shape[0], z.shape[-1])))
    model_h = _entropy(logits)
    u = jnp.full(params.gain.shape, u0, jnp.float32)
    temps, entropies = [], []
    for _ in range(steps):
        out = _step(logits, model_h, u, params)
        temps.append(np.asarray(out.temperature))
        entropies.append(np.asarray(out.sampled_entropy))
        u = out.log_temperature
    return np.array(temps), np.array(entropies)


def _zipf_logits(vocab: int, exponent: float) -> np.ndarray:
    return (-exponent * np.log(np.arange(1, vocab + 1))).astype(np.float32)


@st.composite
def adversarial(draw):
    vocab = draw(st.sampled_from([2, 50, 4096]))
    steps = draw(st.integers(1, 12))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    seq = []
    for _ in range(steps):
        kind = draw(st.sampled_from(["normal", "huge", "masked", "onehot", "flat"]))
        z = rng.normal(0, draw(st.sampled_from([0.01, 1.0, 30.0])), (2, vocab)).astype(np.float32)
        if kind == "huge":
            z *= 1e6
        elif kind == "masked":
            z[:, 1:] = -np.inf
        elif kind == "onehot":
            z[:] = -1e30
            z[:, 0] = 0.0
        elif kind == "flat":
            z[:] = 7.0
        seq.append(z)
    t_min = draw(st.floats(0.01, 2.0))
    t_max = t_min * draw(st.floats(1.0, 50.0))
    params = _params(
        2,
        target_entropy=draw(st.floats(0.0, 15.0)),
        t_min=t_min,
        t_max=t_max,
        gain=draw(st.floats(0.0, 100.0)),
        max_step=draw(st.floats(0.001, 10.0)),
        entropy_floor=draw(st.floats(0.0, 3.0)),
    )
    return seq, params, t_min, t_max


@settings(max_examples=examples(80), deadline=None)
@given(adversarial())
def test_temperature_and_entropy_stay_bounded_for_any_input(case):
    seq, params, t_min, t_max = case
    u = jnp.full((2,), math.log(max(t_min, 1e-3)), jnp.float32)
    for z in seq:
        logits = jnp.asarray(z)
        out = _step(logits, _entropy(logits), u, params)
        t = np.asarray(out.temperature)
        h = np.asarray(out.sampled_entropy)
        assert np.all(np.isfinite(t)) and np.all(np.isfinite(h))
        greedy = t == 0.0
        assert np.all(greedy | ((t >= t_min * (1 - 1e-5)) & (t <= t_max * (1 + 1e-5))))
        assert np.all(h >= -1e-5) and np.all(h <= math.log(z.shape[-1]) + 1e-4)
        u = out.log_temperature
        assert np.all(np.isfinite(np.asarray(u)))


@pytest.mark.parametrize(
    "vocab,exponent,target,gain_fraction",
    [(1000, 1.1, 3.0, 1.0), (1000, 1.1, 5.5, 0.5), (49152, 1.3, 2.0, 0.9), (49152, 0.9, 7.0, 1.0)],
)
def test_converges_within_the_proved_step_count(vocab, exponent, target, gain_fraction):
    z = _zipf_logits(vocab, exponent)
    t_min, t_max, max_step = 0.3, 3.0, 0.25
    u_min, u_max = math.log(t_min), math.log(t_max)
    assert entropy_and_slope(z, u_min)[0] < target < entropy_and_slope(z, u_max)[0]  # reachable
    m, big_m = slope_range(z, u_min, u_max)
    gain = gain_fraction / big_m
    bound = steps_to_converge(u_min, u_max, gain, max_step, m, big_m, tol=0.05)
    assert bound < 1000  # the bound itself is practical for these plants

    params = _params(
        2, target_entropy=target, t_min=t_min, t_max=t_max, gain=gain, max_step=max_step
    )
    for u0 in (u_min, u_max):  # the worst starts: either end of the range
        _, entropies = _run(z, params, u0, bound + 20)
        errors = np.abs(entropies[:, 0] - target)
        assert np.all(errors[bound:] < 0.05), (bound, errors[bound - 3 : bound + 3])
        # gain <= 1/M: no overshoot, the error keeps its sign (up to float32 rounding)
        signed = (entropies[:, 0] - target) * np.sign(entropies[0, 0] - target)
        assert np.all(signed > -1e-3)


@pytest.mark.parametrize("target,expected", [(20.0, "t_max"), (0.01, "t_min")])
def test_unreachable_target_saturates_at_the_bound(target, expected):
    z = _zipf_logits(1000, 1.1)
    params = _params(1, target_entropy=target, t_min=0.3, t_max=3.0, gain=0.3, max_step=0.25)
    temps, entropies = _run(z, params, 0.0, 60)
    bound = {"t_max": 3.0, "t_min": 0.3}[expected]
    np.testing.assert_allclose(temps[-20:, 0], bound, rtol=1e-5)
    u_end = math.log(bound)
    np.testing.assert_allclose(entropies[-1, 0], entropy_and_slope(z, u_end)[0], rtol=1e-4)


def test_entropy_floor_samples_greedily_and_freezes_the_state():
    z = np.zeros((1, 100), np.float32)
    z[0, 0] = 20.0  # model entropy ~ 2e-7 nats: sure
    params = _params(1, target_entropy=3.0, entropy_floor=0.5)
    logits = jnp.asarray(z)
    u = jnp.asarray([0.4], jnp.float32)
    out = _step(logits, _entropy(logits), u, params)
    assert float(out.temperature[0]) == 0.0
    assert float(out.sampled_entropy[0]) == 0.0
    assert float(out.log_temperature[0]) == pytest.approx(0.4)


def _tracking_run(sequence: list[np.ndarray], params: ControllerParams, u0: float):
    """Apply the tracking controller to one row's logits, one distribution per step."""
    u = jnp.full((1,), u0, jnp.float32)
    base = no_base_entropy(u)
    temps, targets = [], []
    for z in sequence:
        logits = jnp.asarray(z[None])
        out = _step(logits, _entropy(logits), u, params, 1, base)
        temps.append(float(out.temperature[0]))
        targets.append(float(out.base.mean[0]))
        u, base = out.log_temperature, out.base
    return np.array(temps), np.array(targets), base


def test_tracking_target_is_the_running_mean_of_the_base_temperatures_entropy():
    # Hand truth: the mean of H(softmax(z_i / T0)) over the steps above the floor, computed
    # in float64 by numpy; a sure step (below the floor) is greedy and not counted.
    rng = np.random.default_rng(3)
    sequence = [rng.normal(0, scale, 500).astype(np.float32) for scale in (0.5, 2.0, 4.0, 1.0)]
    sure = np.full(500, -30.0, np.float32)
    sure[7] = 30.0
    sequence.insert(2, sure)
    t_base = 0.7
    params = _params(1, entropy_floor=0.3, track_base=True, t_base=t_base, gain=0.2)
    _, means, base = _tracking_run(sequence, params, math.log(t_base))

    def entropy(z, t):
        p = np.exp((z - z.max()) / t, dtype=np.float64)
        p /= p.sum()
        return float(-np.sum(p * np.log(np.maximum(p, 1e-300))))

    counted = [entropy(z, t_base) for z in sequence if entropy(z, 1.0) >= 0.3]
    assert len(counted) == 4 and float(base.steps[0]) == 4.0
    expected = np.cumsum(counted) / np.arange(1, 5)
    np.testing.assert_allclose(np.delete(means, 2), expected, rtol=1e-4)
    assert means[2] == means[1]  # the sure step left the mean alone


def test_tracking_controller_on_a_stationary_text_converges_to_the_base_temperature():
    # The fixed point of holding H(z / T0)'s mean on one distribution is T0 itself, whatever
    # the fixed target says and wherever the state starts.
    z = _zipf_logits(1000, 1.1)
    t_base = 0.7
    params = _params(1, target_entropy=6.0, track_base=True, t_base=t_base, gain=0.2)
    temps, _, _ = _tracking_run([z] * 120, params, math.log(2.5))
    np.testing.assert_allclose(temps[-10:], t_base, rtol=2e-3)
    # the same row with a fixed target goes where that target is
    fixed = _params(1, target_entropy=6.0, gain=0.2)
    temps, entropies = _run(z, fixed, math.log(2.5), 120)
    assert entropies[-1, 0] == pytest.approx(6.0, abs=0.05) and temps[-1, 0] > 1.2
