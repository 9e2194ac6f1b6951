"""Named pruning settings shared by the pruning benchmarks, spanning the quality/budget curve.

Fixed fractions are entropy-blind controls; the ramps follow the entropy; "default" is
`PruningConfig(enabled=True)` whatever its defaults are.
"""

from __future__ import annotations

from etjax.pruning.config import PruningConfig


def _fixed(fraction: float, **extra) -> PruningConfig:
    # An entropy-blind control: the ramp starts above any entropy, so the floor always applies.
    return PruningConfig(
        enabled=True, min_fraction=fraction, entropy_low=99.0, entropy_high=100.0, **extra
    )


def _ramp(floor: float, low: float, high: float, **extra) -> PruningConfig:
    return PruningConfig(
        enabled=True, min_fraction=floor, entropy_low=low, entropy_high=high, **extra
    )


SETTINGS: dict[str, PruningConfig] = {
    "fixed 50%": _fixed(0.5),
    "fixed 25%": _fixed(0.25),
    "fixed 25%, per-head selection": _fixed(0.25, share_heads=False),
    "fixed 25%, remembered mass >= 0.02": _fixed(0.25, mass_threshold=0.02),
    "fixed 12.5%": _fixed(0.125),
    "fixed 6.25%": _fixed(0.0625),
    "entropy 0.5-4 nats, floor 20%, tail upper bound": _ramp(0.2, 0.5, 4.0, signal="upper_bound"),
    "entropy 0.5-4 nats, floor 20%": _ramp(0.2, 0.5, 4.0),
    "entropy 1-6 nats, floor 10%": _ramp(0.1, 1.0, 6.0),
    "entropy 2-8 nats, floor 5%": _ramp(0.05, 2.0, 8.0),
    "entropy 1-6 nats, floor 10%, remembered mass >= 0.02": _ramp(
        0.1, 1.0, 6.0, mass_threshold=0.02
    ),
    "entropy 2-8 nats, floor 20%, remembered mass >= 0.02": _ramp(
        0.2, 2.0, 8.0, mass_threshold=0.02
    ),
    "fixed 25%, remembered mass >= 0.01": _fixed(0.25, mass_threshold=0.01),
}
SETTINGS["default"] = PruningConfig(enabled=True)
