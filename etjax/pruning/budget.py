"""From the entropy signal to a number of KV blocks to read."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from etjax.entropy.estimators import tail_bounds
from etjax.pruning.config import PruningConfig, PruningShape, PruningThresholds


def budget_entropy(
    logits: jax.Array,
    exact: jax.Array,
    cfg: PruningConfig | PruningShape,
    temperature: jax.Array | None = None,
) -> jax.Array:
    """The entropy [B] the budget follows: `exact` [B] as given, or the tail upper bound of
    softmax(logits [B, V] / temperature [B]) (the entropy signal's calibration; None = 1)."""
    if cfg.signal == "exact":
        return exact
    if temperature is not None:
        logits = logits / temperature.astype(logits.dtype)[:, None]  # x / 1 is x exactly
    return tail_bounds(logits, cfg.estimator_k)[1]


def kept_fraction(entropy: jax.Array, cfg: PruningConfig | PruningThresholds, xp=jnp) -> jax.Array:
    """Fraction [B] of blocks to keep, monotone nondecreasing in the entropy [B] (nats).

    `xp=np` computes it on the host in the entropy's precision (the calibration fit solves
    for a ramp shift with it, etjax/calibration/ramp.py)."""
    ramp = (entropy - cfg.entropy_low) / (cfg.entropy_high - cfg.entropy_low)
    return cfg.min_fraction + (1.0 - cfg.min_fraction) * xp.clip(ramp, 0.0, 1.0)


def kept_block_count(
    fraction: jax.Array, num_blocks: jax.Array, cfg: PruningConfig | PruningThresholds, xp=jnp
) -> jax.Array:
    """Blocks [B] int32 to keep out of `num_blocks` [B]: the fraction, rounded up, with floors.

    At least `min_blocks` and the always-kept sinks and recent window; never more than exist.
    `xp=np` computes it on the host: the engine sizes its tables from it every round, and
    eager jnp calls would compile a small program for every new batch size.
    """
    wanted = xp.ceil(fraction * num_blocks).astype(xp.int32)
    floor = xp.maximum(cfg.min_blocks, cfg.sink_blocks + cfg.recent_blocks)
    return xp.minimum(xp.maximum(wanted, floor), num_blocks)
