"""The pages' Quest bounds in XLA: a loop over slices of the page table up to the batch's
longest row (the package docstring's signature)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.page_scores.reference import block_upper_bounds

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
