"""`retract_rejected`: what a verification pass leaves behind is taken back.

A speculating row writes the keys and values of its token and all its drafts before it knows
which drafts it keeps (etjax/runtime/verify.py). Its committed length already stops at the
accepted prefix, so attention never reads the rest, and the engine reserved the pages they
landed in before the step (a round's pages cover `steps_per_sync` >= 1 + max_draft
positions), so the allocator has nothing to undo. What does outlive the pass is the per-page
key bounds (etjax/pruning/block_scores.py): a min/max cannot forget a key folded into it, and
a rejected key would widen its page's bounds for as long as the page is in use, changing the
blocks a pruned step keeps. So the bounds of each page that holds a rejected position are
recomputed from the keys below the row's length, in every layer: afterwards they are what a
run without speculation would hold. The rejected keys and values themselves stay past the
length, where nothing reads them and the next tokens overwrite them (a page reused from
another sequence holds stale entries there too).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from etjax.cache.kv_cache import KVCache


def retract_rejected(
    cache: KVCache,
    written_pages: jax.Array,
    start: jax.Array,
    written: jax.Array,
    length: jax.Array,
) -> KVCache:
    """Recompute the key bounds of the pages holding rows' rejected positions.

    written_pages: [B, m] the page each of a row's m = 1 + max_draft slots wrote to (the null
    page where nothing was written); start: [B] the position of slot 0; written: [B] how many
    slots were written (0 for a row that wrote nothing); length: [B] the row's length after
    verification. Positions in [length, start + written) were written and are not kept.
    """
    page_size = cache.k.shape[3]
    span = written_pages.shape[1]
    num_pages = cache.k.shape[1]
    end = start + written  # one past the last written position
    # A run of `span` positions touches at most this many pages.
    touched = (span + page_size - 2) // page_size + 1
    first = length // page_size
    pages, kept_slots = [], []
    for i in range(touched):
        page_start = (first + i) * page_size
        # The first rejected position on this page, as a slot of the row's written run.
        slot = jnp.maximum(length, page_start) - start
        rejected_here = (slot < written) & (end > length)
        own = jnp.take_along_axis(written_pages, jnp.clip(slot, 0, span - 1)[:, None], 1)[:, 0]
        pages.append(jnp.where(rejected_here, own, num_pages))  # out of range: left alone
        kept_slots.append(jnp.clip(length - page_start, 0, page_size))
    pages = jnp.concatenate(pages)
    kept_slots = jnp.concatenate(kept_slots)

    def recompute(cache: KVCache) -> KVCache:
        keys = cache.k.at[:, pages].get(mode="fill", fill_value=0).astype(jnp.float32)
        # keys: [L, M, KVH, page_size, hd]; the slots below each page's kept count are real.
        real = (jnp.arange(page_size) < kept_slots[:, None])[None, :, None, :, None]
        k_min = jnp.min(jnp.where(real, keys, jnp.inf), axis=3)
        k_max = jnp.max(jnp.where(real, keys, -jnp.inf), axis=3)
        return cache.replace(
            k_min=cache.k_min.at[:, pages].set(k_min, mode="drop"),
            k_max=cache.k_max.at[:, pages].set(k_max, mode="drop"),
        )

    # Most steps reject nothing (no row drafted, or all drafts held): they skip the gather.
    return jax.lax.cond(jnp.any(pages < num_pages), recompute, lambda cache: cache, cache)
