"""Block selection in XLA: a rank of every block, then `lax.top_k` (the package docstring)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Added to the score of a block that drew at least `mass_threshold` when last read, so such
# blocks rank after the forced ones and before the rest (select_blocks.cc adds the same).
# Scaled attention logits (and their bounds) of a working model are orders of magnitude
# smaller; float32 still orders bounds that differ by more than 0.06 among the hot blocks.
RECENTLY_HOT = 1e6


def select_blocks_xla(
    scores: jax.Array,
    num_blocks: jax.Array,
    budget: jax.Array,
    sink_blocks: jax.Array | int,
    recent_blocks: jax.Array | int,
    mass_threshold: jax.Array | float,
    max_kept: int,
    last_mass: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Pick the kept blocks: sinks and the recent window always, then recently hot blocks
    (those whose `last_mass` reached `mass_threshold`; None ranks by the scores alone),
    then the highest scores.

    scores: [B, S, P] float32 with S = KVH (per-head selection) or 1 (shared by the heads);
    num_blocks: [B] blocks holding the sequence; budget: [B] blocks to keep; sink_blocks,
    recent_blocks, mass_threshold: scalars; max_kept: static width of the result; last_mass:
    [B, S, P] mass each block drew when last read. Returns kept_blocks [B, S, max_kept] int32
    (logical block ids, the first kept_counts valid, the rest repeat valid ids) and
    kept_counts [B, S] int32.
    """
    b, kvh, p = scores.shape
    block = jnp.arange(p)[None, None, :]
    n = num_blocks[:, None, None]
    forced = (block < sink_blocks) | ((block >= n - recent_blocks) & (block < n))
    if last_mass is not None:
        scores = jnp.where(last_mass >= mass_threshold, scores + RECENTLY_HOT, scores)
    ranked = jnp.where(forced, jnp.inf, jnp.where(block < n, scores, -jnp.inf))
    _, order = jax.lax.top_k(ranked, min(max_kept, p))
    counts = jnp.minimum(jnp.minimum(budget, num_blocks), max_kept)
    counts = jnp.broadcast_to(counts[:, None], (b, kvh)).astype(jnp.int32)
    if order.shape[-1] < max_kept:
        order = jnp.pad(order, ((0, 0), (0, 0), (0, max_kept - order.shape[-1])))
    # Entries past the count repeat a kept id so every entry is a valid column.
    slot = jnp.arange(max_kept)[None, None, :]
    order = jnp.where(slot < counts[..., None], order, order[..., :1])
    return order.astype(jnp.int32), counts
