"""Query-aware block scores from per-page key bounds (Quest-style), kept current as pages fill.

For a page holding keys k_1..k_n of one KV head, keep the elementwise min and max over its
slots. For any query q, every key in the page satisfies

    q . k = sum_d q_d k_d <= sum_d max(q_d * kmin_d, q_d * kmax_d)

so the right-hand side bounds the largest attention logit the page can produce: a page whose
bound is low cannot hold much attention mass. With grouped-query attention the block score of
a KV head is the largest bound over the query heads that share it, and a selection shared by
the KV heads scores a page by the largest bound over all its heads.

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


def block_upper_bounds(
    q: jax.Array, k_min: jax.Array, k_max: jax.Array, page_table: jax.Array
) -> jax.Array:
    """Upper bound of the (scaled) attention logit per block and KV head: [B, KVH, P].

    q: [B, H, hd] queries (RoPE applied, unscaled); k_min, k_max: [N, KVH, hd];
    page_table: [B, P].
    """
    b, h, hd = q.shape
    kvh = k_min.shape[1]
    qg = q.reshape(b, kvh, h // kvh, 1, hd).astype(jnp.float32)
    lo = k_min[page_table].transpose(0, 2, 1, 3)[:, :, None]  # [B, KVH, 1, P, hd]
    hi = k_max[page_table].transpose(0, 2, 1, 3)[:, :, None]
    bound = jnp.sum(jnp.maximum(qg * lo, qg * hi), axis=-1)  # [B, KVH, G, P]
    return jnp.max(bound, axis=2) * hd**-0.5


# Pages scored per loop trip of `score_pages_xla`.
SCORE_PAGES = 32


def score_pages_xla(
    q: jax.Array,
    k_min: jax.Array,
    k_max: jax.Array,
    page_table: jax.Array,
    num_blocks: jax.Array,
    shared: bool,
) -> jax.Array:
    """Quest bounds of every page of each row, [B, 1 if shared else KVH, P], in XLA: the
    page table is as wide as the longest sequence the engine holds; a loop of SCORE_PAGES-page
    slices up to the batch's longest row (a traced count) reads only the pages rows have.
    q [B, H, hd]; k_min, k_max [N, KVH, hd]; num_blocks [B]."""
    b, p = page_table.shape
    kvh = k_min.shape[1]
    heads = 1 if shared else kvh
    chunk = min(SCORE_PAGES, p)
    padded = -(-p // chunk) * chunk
    table = jnp.pad(page_table, ((0, 0), (0, padded - p)))  # the null page: masked later

    def body(i, scores):
        pages = jax.lax.dynamic_slice_in_dim(table, i * chunk, chunk, axis=1)
        part = block_upper_bounds(q, k_min, k_max, pages)  # [B, KVH, C]
        if shared:
            part = part.max(axis=1, keepdims=True)
        return jax.lax.dynamic_update_slice_in_dim(scores, part, i * chunk, axis=2)

    init = jnp.full((b, heads, padded), -jnp.inf, jnp.float32)
    trips = (jnp.max(num_blocks) + chunk - 1) // chunk
    return jax.lax.fori_loop(0, trips, body, init)[..., :p]
