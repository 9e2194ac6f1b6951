"""The quantities docs/STABILITY.md states its guarantees in, computed independently in float64.

f(u) = H(softmax(z * exp(-u))) is the entropy at log-temperature u; its slope is the
varentropy. For a stationary distribution these give the gain condition and step bound.
"""

from __future__ import annotations

import math

import numpy as np


def entropy_and_slope(z: np.ndarray, u: float) -> tuple[float, float]:
    """Entropy and varentropy (= dH/du) of softmax(z / e^u), float64."""
    x = z.astype(np.float64) * math.exp(-u)
    x = x[np.isfinite(x)]
    x = x - x.max()
    p = np.exp(x)
    p /= p.sum()
    log_p = np.log(np.where(p > 0, p, 1.0))
    h = float(-(p * log_p).sum())
    v = float((p * (log_p + h) ** 2).sum())
    return h, v


def slope_range(
    z: np.ndarray, u_min: float, u_max: float, points: int = 801
) -> tuple[float, float]:
    """(m, M): min and max varentropy over [u_min, u_max], on a fine grid."""
    slopes = [entropy_and_slope(z, u)[1] for u in np.linspace(u_min, u_max, points)]
    return min(slopes), max(slopes)


def steps_to_converge(
    u_min: float, u_max: float, gain: float, max_step: float, m: float, big_m: float, tol: float
) -> int:
    """The step count N(tol) of docs/STABILITY.md, Theorem 2 (gain <= 1 / M)."""
    width = u_max - u_min
    saturated = math.ceil(width / max_step)
    rate = 1.0 - gain * m
    linear = math.ceil(math.log(big_m * width / tol) / -math.log(rate))
    return saturated + max(linear, 0)
