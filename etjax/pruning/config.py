"""`PruningConfig`: how the attention budget follows the entropy signal."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PruningConfig:
    """Settings of entropic attention pruning (static: part of the compiled step).

    The kept fraction of a sequence's blocks is a monotone function of the conservative
    (tail-corrected upper bound) model entropy of its previous step, H:

        fraction = min_fraction                       if H <= entropy_low
                 = 1                                  if H >= entropy_high
                 = linear between the two             otherwise

    and never fewer than `min_blocks` blocks. The first `sink_blocks` blocks (attention sinks)
    and the last `recent_blocks` (the local window, which holds the current token) are always
    kept and count towards the budget.
    """

    enabled: bool = False
    min_fraction: float = 0.2
    entropy_low: float = 0.5
    entropy_high: float = 4.0
    sink_blocks: int = 1
    recent_blocks: int = 2
    min_blocks: int = 4
    estimator_k: int = 64  # top-k of the tail-corrected entropy bound

    def __post_init__(self) -> None:
        if not 0 < self.min_fraction <= 1:
            raise ValueError(f"min_fraction={self.min_fraction}; must be in (0, 1]")
        if not 0 <= self.entropy_low < self.entropy_high:
            raise ValueError(
                f"entropy_low={self.entropy_low}, entropy_high={self.entropy_high}; need "
                "0 <= entropy_low < entropy_high"
            )
        for name in ("sink_blocks", "recent_blocks", "min_blocks", "estimator_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < (1 if name == "estimator_k" else 0):
                raise ValueError(f"{name}={value!r}; must be a non-negative integer")
