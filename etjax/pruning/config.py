"""`PruningConfig`: how the attention budget follows the entropy signal.

The step programs take it in two parts: `PruningShape`, what changes the program (static), and
`PruningThresholds`, its numbers (traced), so engines and tests that differ only in thresholds
run the same compiled programs.
"""

from __future__ import annotations

from dataclasses import dataclass

import flax.struct
import jax
import numpy as np

from etjax.errors import FieldError

SIGNALS = ("exact", "upper_bound")


@dataclass(frozen=True)
class PruningConfig:
    """Settings of entropic attention pruning.

    The kept fraction of a sequence's blocks is a monotone function of the model entropy H of
    its previous step (`signal`):

        fraction = min_fraction                       if H <= entropy_low
                 = 1                                  if H >= entropy_high
                 = linear between the two             otherwise

    and never fewer than `min_blocks` blocks. The thresholds are on the model's raw entropy
    scale; under an entropy calibration the engine moves both by the calibration's
    `ramp_shift`, so the setting keeps its budget (etjax/calibration/ramp.py). The first
    `sink_blocks` blocks (attention sinks) and the last `recent_blocks` (the local window,
    which holds the current token) are always kept and count towards the budget.

    `signal`: "exact" reads the exact entropy the sampler computes anyway over the full
    vocabulary (free, and the tightest value); "upper_bound" reads the tail-corrected upper
    bound from the top `estimator_k` logits, for engines that never form the full entropy.
    The bound is never below the exact value, so it keeps at least as many blocks.

    `share_heads`: one selection per (layer, sequence), scored by the largest bound over its
    KV heads, instead of one per KV head. Gathers then move whole pages (all heads at once,
    contiguous in the pool); per-head selection can keep fewer keys for the same quality.

    `mass_threshold`: blocks whose attention mass, last time they were read, was at least this
    are ranked before all others (after sinks and the recent window); 0 ranks by the key
    bound alone.

    `group_shared_prefixes`: rows that share a prefix through the prefix cache (questions on
    one document) select its blocks together, at their most uncertain row's fraction, and
    the C++ kernel reads them once for the group (etjax/pruning/groups.py); only on the
    `cpu` attention backend, the others select row by row. Off by default: it reads fewer
    bytes (0.43x on `long`) but each row attends more blocks, and on a CPU, where the
    document stays in cache, that made the step slower (docs/PERF.md "pruned_groups").
    """

    # Defaults chosen from the measured quality/fraction curve (docs/PERF.md, pruning quality):
    # at 8K tokens they read 36% of the blocks for a perplexity ratio of 0.9995 (worst of four
    # documents 1.006); a fixed 25% with the same mass ranking reads less for more loss (ratio
    # 1.010, worst 1.020).
    enabled: bool = False
    min_fraction: float = 0.2
    entropy_low: float = 2.0
    entropy_high: float = 8.0
    sink_blocks: int = 1
    recent_blocks: int = 2
    min_blocks: int = 4
    signal: str = "exact"
    estimator_k: int = 64  # top-k of the tail-corrected entropy bound (signal="upper_bound")
    share_heads: bool = True
    mass_threshold: float = 0.02
    group_shared_prefixes: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.min_fraction <= 1:
            raise FieldError("min_fraction", self.min_fraction, "in (0, 1]")
        if not 0 <= self.entropy_low < self.entropy_high:
            raise FieldError(
                "entropy_low", self.entropy_low, f"in [0, entropy_high={self.entropy_high})"
            )
        for name in ("sink_blocks", "recent_blocks", "min_blocks", "estimator_k"):
            value = getattr(self, name)
            least = 1 if name == "estimator_k" else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise FieldError(name, value, f"an integer >= {least}")
        if self.signal not in SIGNALS:
            raise FieldError("signal", self.signal, f"one of {SIGNALS}")
        if not 0 <= self.mass_threshold <= 1:
            raise FieldError("mass_threshold", self.mass_threshold, "in [0, 1]")

    @property
    def ranks_by_mass(self) -> bool:
        """Whether recently hot blocks rank first (and the mass each read draws is kept)."""
        return self.mass_threshold > 0

    def shape(self) -> PruningShape:
        """The settings a step program is compiled for."""
        return PruningShape(
            enabled=self.enabled,
            signal=self.signal,
            estimator_k=self.estimator_k,
            share_heads=self.share_heads,
            ranks_by_mass=self.ranks_by_mass,
        )

    def thresholds(self) -> PruningThresholds:
        """The numbers a step program reads at run time (host scalars)."""
        return PruningThresholds(
            min_fraction=np.float32(self.min_fraction),
            entropy_low=np.float32(self.entropy_low),
            entropy_high=np.float32(self.entropy_high),
            sink_blocks=np.int32(self.sink_blocks),
            recent_blocks=np.int32(self.recent_blocks),
            min_blocks=np.int32(self.min_blocks),
            mass_threshold=np.float32(self.mass_threshold),
        )


@dataclass(frozen=True)
class PruningShape:
    """The part of a `PruningConfig` that shapes a compiled step: a static argument."""

    enabled: bool
    signal: str
    estimator_k: int
    share_heads: bool
    ranks_by_mass: bool


@flax.struct.dataclass
class PruningThresholds:
    """The numbers of a `PruningConfig`, traced in the step programs (scalars; the meanings
    are the config's). `kept_fraction`, `kept_block_count` and `select_blocks` read these
    fields by name, so they take a `PruningConfig` as well (on the host, or as constants)."""

    min_fraction: jax.Array
    entropy_low: jax.Array
    entropy_high: jax.Array
    sink_blocks: jax.Array
    recent_blocks: jax.Array
    min_blocks: jax.Array
    mass_threshold: jax.Array
