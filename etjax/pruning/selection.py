"""Choose the kept blocks of each (sequence, KV head) from scores and a budget, by the
pruning settings: the settings unpacked for a selection kernel (pallas_kernels/block_selection,
whose docstring states the rule)."""

from __future__ import annotations

from collections.abc import Callable

import jax

from etjax.pruning.config import PruningConfig, PruningThresholds
from pallas_kernels.block_selection import select_blocks_xla


def select_blocks(
    scores: jax.Array,
    num_blocks: jax.Array,
    budget: jax.Array,
    cfg: PruningConfig | PruningThresholds,
    max_kept: int,
    last_mass: jax.Array | None = None,
    kernel: Callable = select_blocks_xla,
) -> tuple[jax.Array, jax.Array]:
    """Pick the kept blocks: sinks and the recent window always, then recently hot blocks
    (those whose `last_mass` reached `cfg.mass_threshold`; None ranks by the scores alone),
    then the highest scores, on `kernel` (the XLA one, or the C++ one of the `cpu` backend:
    etjax/attention/backend.py's `block_selection`).

    scores: [B, S, P] float32 with S = KVH (per-head selection) or 1 (shared by the heads);
    num_blocks: [B] blocks holding the sequence; budget: [B] blocks to keep (from
    `kept_block_count`); max_kept: static width of the result; last_mass: [B, S, P] mass each
    block drew when last read. Returns kept_blocks [B, S, max_kept] int32 (logical block ids,
    the first kept_counts valid, the rest repeat valid ids) and kept_counts [B, S] int32.
    """
    return kernel(
        scores,
        num_blocks,
        budget,
        cfg.sink_blocks,
        cfg.recent_blocks,
        cfg.mass_threshold,
        max_kept,
        last_mass,
    )
