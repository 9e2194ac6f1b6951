"""The pruning ramp on the calibrated entropy scale: a shift that keeps its budget.

The pruning ramp's thresholds (`PruningConfig.entropy_low` / `entropy_high`) were chosen on the
model's raw entropy (docs/PERF.md, pruning quality): at the default setting they read about a
third of the blocks for a perplexity ratio near 1. A calibration with T > 1 raises every
step's entropy (by about 0.3-0.4 nats at T = 1.06), so the same thresholds read against the
calibrated signal spend a larger budget: a different point on the quality/cost curve, not
the same setting with a better signal. To pair the two, the calibration fit also finds the
shift d of the ramp for which the calibrated signal, on the fit text, keeps the same mean
fraction of blocks as the raw signal under the unshifted ramp:

    mean_i ramp(Hcal_i; low + d, high + d)  =  mean_i ramp(Hraw_i; low, high)

Then a calibration changes which steps get the blocks, not how many, and the setting's
cost/quality point is the one it was chosen as. One number, one equation, solved on the fit
text (never on text the result is measured on). The left side is continuous and
nonincreasing in d (the ramp is a clipped line), so bisection finds the root.

Why a shift and not a quantile map of each threshold: the upper threshold (8 nats) sits in the
far tail of a model's entropies (often no fit token reaches it), where a quantile is not
estimable, while the budget a ramp spends is estimated from every token. Why the default ramp:
it is the setting the engine ships; a user's own ramp gets the same shift, the first-order
pairing (the temperature's effect on entropy varies little across the ramp's middle).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from etjax.errors import CalibrationError
from etjax.pruning.budget import kept_fraction
from etjax.pruning.config import PruningConfig, PruningThresholds

_BISECTION_STEPS = 60  # halves a bracket of at most ~40 nats to below 1e-16 of a nat


def ramp_shift(raw: np.ndarray, calibrated: np.ndarray, ramp: PruningConfig | None = None) -> float:
    """The shift d (nats) of `ramp`'s thresholds (default: `PruningConfig()`'s) under which
    the `calibrated` entropies [N] keep the mean fraction of blocks the `raw` entropies [N]
    keep under the unshifted ramp. 0 exactly when the two are equal (no calibration)."""
    raw = np.asarray(raw, np.float64)
    calibrated = np.asarray(calibrated, np.float64)
    if raw.ndim != 1 or raw.shape != calibrated.shape or raw.size == 0:
        raise CalibrationError(
            f"ramp_shift: raw {raw.shape} and calibrated {calibrated.shape} entropies must be "
            "two non-empty [N] arrays of the same positions"
        )
    if not (np.isfinite(raw).all() and np.isfinite(calibrated).all()):
        raise CalibrationError("ramp_shift: the entropies hold NaN or infinity")
    ramp = ramp or PruningConfig()
    if np.array_equal(raw, calibrated):
        return 0.0
    target = _mean_kept(raw, ramp, 0.0)
    # Bracket: shifted this far down every step keeps everything, this far up the floor.
    low = float(calibrated.min() - ramp.entropy_high) - 1.0
    high = float(calibrated.max() - ramp.entropy_low) + 1.0
    for _ in range(_BISECTION_STEPS):
        middle = (low + high) / 2
        if _mean_kept(calibrated, ramp, middle) > target:
            low = middle  # keeps too much: the ramp must move further up
        else:
            high = middle
    return (low + high) / 2


def shifted_thresholds(thresholds: PruningThresholds, shift: float) -> PruningThresholds:
    """`thresholds` with the ramp moved by `shift` nats (both ends; its width, floor and the
    block counts unchanged). The engine's traced thresholds under a calibration."""
    return dataclasses.replace(
        thresholds,
        entropy_low=np.float32(thresholds.entropy_low + shift),
        entropy_high=np.float32(thresholds.entropy_high + shift),
    )


def _mean_kept(entropy: np.ndarray, ramp: PruningConfig, shift: float) -> float:
    # The ramp's mean kept fraction over positions, in float64 on the host.
    moved = dataclasses.replace(
        ramp.thresholds(),
        min_fraction=np.float64(ramp.min_fraction),
        entropy_low=np.float64(ramp.entropy_low + shift),
        entropy_high=np.float64(ramp.entropy_high + shift),
    )
    return float(np.mean(kept_fraction(entropy, moved, xp=np)))
