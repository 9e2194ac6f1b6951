"""The pruning ramp paired with a calibration (etjax/calibration/ramp.py): the shift against
hand-solved examples and the properties that define it (the default budget kept on the fit
data, a translation undone exactly, the sign and order of T), and its refusals."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from etjax.calibration.ramp import ramp_shift, shifted_thresholds
from etjax.errors import CalibrationError
from etjax.pruning.budget import kept_fraction
from etjax.pruning.config import PruningConfig

DEFAULT = PruningConfig()  # min_fraction 0.2, ramp 2 -> 8 nats


def _entropies(t: float, n: int = 400, v: int = 256, seed: int = 0) -> np.ndarray:
    # float64 entropies of softmax(z / t) of random logits spread over the ramp (about 2-5.5
    # nats at t = 1): scales vary by row, as a model's confidence does by step.
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((n, v)) * rng.uniform(0.5, 4.0, size=(n, 1))
    x = z / t
    log_p = x - x.max(axis=1, keepdims=True)
    log_p -= np.log(np.exp(log_p).sum(axis=1, keepdims=True))
    return -(np.exp(log_p) * log_p).sum(axis=1)


def test_a_translated_signal_gets_the_same_translation():
    # Fractions of [1, 3, 5, 9] under the default ramp: 0.2, 1/3, 0.6, 1. Raising every value
    # by 0.5 nats is undone by moving the ramp 0.5 nats (two values lie inside it: unique).
    raw = np.array([1.0, 3.0, 5.0, 9.0])
    assert ramp_shift(raw, raw + 0.5) == pytest.approx(0.5, abs=1e-9)


def test_shift_solved_by_hand():
    # raw [3, 5] keeps (1/3 + 0.6) / 2 = 7/15. Calibrated [3.6, 5.2], both inside the ramp:
    # 0.2 + 0.8 * (1.6 + 3.2 - 2d) / 12 = 7/15  =>  4.8 - 2d = 4  =>  d = 0.4.
    assert ramp_shift(np.array([3.0, 5.0]), np.array([3.6, 5.2])) == pytest.approx(0.4, abs=1e-9)


def test_equal_signals_need_no_shift():
    raw = _entropies(1.0)
    assert ramp_shift(raw, raw.copy()) == 0.0  # exactly: no calibration, no change


def test_the_paired_ramp_keeps_the_default_budget_on_the_fit_data():
    raw = _entropies(1.0)
    for t in (0.8, 1.06, 1.5):
        calibrated = _entropies(t)
        shift = ramp_shift(raw, calibrated)
        # Through the engine's own float32 ramp (jnp), with the traced thresholds it reads.
        moved = shifted_thresholds(DEFAULT.thresholds(), shift)
        kept_raw = float(jnp.mean(kept_fraction(jnp.asarray(raw, jnp.float32), DEFAULT)))
        kept_cal = float(jnp.mean(kept_fraction(jnp.asarray(calibrated, jnp.float32), moved)))
        assert kept_cal == pytest.approx(kept_raw, abs=1e-5)
        # Unshifted, the calibrated signal keeps more (T > 1) or less (T < 1): not the setting.
        unshifted = float(np.mean(kept_fraction(calibrated, DEFAULT, xp=np)))
        assert (unshifted > kept_raw) == (t > 1)


def test_the_shift_grows_with_the_temperature():
    raw = _entropies(1.0)
    shifts = [ramp_shift(raw, _entropies(t)) for t in (0.7, 0.9, 1.1, 1.3)]
    assert shifts[0] < shifts[1] < 0 < shifts[2] < shifts[3]


def test_shifted_thresholds_translate_the_ramp():
    entropy = np.linspace(0.0, 12.0, 49).astype(np.float32)
    moved = shifted_thresholds(DEFAULT.thresholds(), 0.75)
    np.testing.assert_allclose(
        kept_fraction(jnp.asarray(entropy + 0.75), moved),
        kept_fraction(jnp.asarray(entropy), DEFAULT),
        atol=1e-6,
    )
    assert moved.min_fraction == DEFAULT.thresholds().min_fraction  # only the ends move


def test_a_user_ramp_is_paired_too():
    # The shift is solved for whatever ramp is given (a narrower one here), not only the default.
    ramp = PruningConfig(min_fraction=0.1, entropy_low=1.0, entropy_high=4.0)
    raw = _entropies(1.0)
    calibrated = _entropies(1.2)
    shift = ramp_shift(raw, calibrated, ramp)
    moved = shifted_thresholds(ramp.thresholds(), shift)  # float32, as the engine holds them
    assert np.mean(kept_fraction(calibrated, moved, xp=np)) == pytest.approx(
        np.mean(kept_fraction(raw, ramp, xp=np)), abs=1e-6
    )


@pytest.mark.parametrize(
    "raw, calibrated, message",
    [
        (np.ones(3), np.ones(4), r"raw \(3,\) and calibrated \(4,\)"),
        (np.ones((2, 2)), np.ones((2, 2)), r"two non-empty \[N\] arrays"),
        (np.ones(0), np.ones(0), r"two non-empty \[N\] arrays"),
        (np.array([1.0, np.nan]), np.ones(2), "NaN or infinity"),
    ],
)
def test_bad_entropies_are_refused(raw, calibrated, message):
    with pytest.raises(CalibrationError, match=message):
        ramp_shift(raw, calibrated)
