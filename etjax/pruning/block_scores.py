"""What pruned decode scores blocks by, kept current in the cache: per-page key bounds and the
attention mass each row's blocks drew when last read.

A page's elementwise key min and max over its slots bound the largest attention logit any
query can draw from it (Quest); the scorers that read them, in XLA and C++, are the kernels of
pallas_kernels/page_scores. Here they are kept current as pages fill (`update_key_bounds`).

The second signal is the attention mass a block received the last time it was read (returned
by the attention op, remembered in the cache per resident row and logical block, since a
page shared by several sequences draws a different mass from each): a block that drew mass
recently is likely to draw it again, even where its bound ranks it below others. A row's
memory is cleared when a new sequence takes the row over, as a page's was when it was
written again.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def update_key_bounds(
    k_min: jax.Array,
    k_max: jax.Array,
    k_new: jax.Array,
    pages: jax.Array,
    slots: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Fold new keys into their pages' bounds.

    k_min, k_max: [N, KVH, hd]; k_new: [T, KVH, hd] keys being written; pages, slots: [T] where
    they go. A key written to slot 0 starts its page afresh (pages are reused between
    sequences), so the bounds are reset before the fold; the min/max scatters handle several
    keys landing in one page.
    """
    fresh = slots == 0
    reset_pages = jnp.where(fresh, pages, k_min.shape[0])  # out of range: dropped
    k_min = k_min.at[reset_pages].set(jnp.inf, mode="drop")
    k_max = k_max.at[reset_pages].set(-jnp.inf, mode="drop")
    k32 = k_new.astype(k_min.dtype)
    return k_min.at[pages].min(k32), k_max.at[pages].max(k32)


def remember_mass(
    block_mass: jax.Array,
    mass_rows: jax.Array,
    kept: jax.Array,
    observed: jax.Array,
    kept_counts: jax.Array,
    rows: jax.Array,
) -> jax.Array:
    """Store the mass each kept block just received.

    block_mass: [M, W, KVH] per row and logical block; mass_rows: [B] each row's row of it;
    kept: [B, 1|KVH, K] the logical blocks that were read; observed: [B, KVH, K];
    kept_counts: [B, 1|KVH]; rows: [B] bool, rows whose step is real. Padding entries of the
    kept table (past the count), rows that are not real and blocks past W are dropped, so they
    can never overwrite a real observation.
    """
    m, _, kvh = block_mass.shape
    k = kept.shape[-1]
    real = (jnp.arange(k) < kept_counts[..., None]) & rows[:, None, None]
    target = jnp.broadcast_to(jnp.where(real, mass_rows[:, None, None], m), observed.shape)
    blocks = jnp.broadcast_to(kept, observed.shape)
    heads = jnp.broadcast_to(jnp.arange(kvh)[None, :, None], observed.shape)
    return block_mass.at[target, blocks, heads].set(observed, mode="drop")
