"""Block-sparse paged decode attention in XLA: the fast path on CPU.

Gathers only the kept pages, a chunk of `LOOP_BLOCKS` kept blocks per trip of a
`lax.fori_loop` whose trip count follows the largest kept count in the batch (a traced value),
merging the chunks' partial softmaxes online. So a step's cost follows the blocks it keeps,
not the width of the kept table, which the engine pads to one shape (etjax/attention/pruned.py)
so that a run compiles few programs. Within a trip, multiply-and-reduce instead of matrix
products: with one query per sequence the products are tiny and XLA fuses the page gather into
the reductions. Accumulates in float32. A selection shared by the KV heads gathers whole pages
([KVH, ps, hd], contiguous in the pool); a per-head selection gathers one [ps, hd] tile per
(page, head).

Each block's attention mass comes from its log-sum-exp, kept per chunk: mass = exp(block lse -
total lse), the softmax probability the block drew.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.block_sparse.validation import check_inputs

# Kept blocks per loop trip, timed on the 2-core CPU (SmolLM2 heads, 8 rows, 525-page tables,
# pages of 16; 2026-12-01): 131 kept blocks in a table padded to 256 took 3.7-4.5 ms with
# trips of 8 blocks, 3.9-4.6 with 4 or 16, 5.0 with 32, 10 with 64; the unlooped gather over
# the whole table took 20-24 ms (and 6-8 ms over an unpadded 128).
LOOP_BLOCKS = 8
_MASKED = -1e30


def block_sparse_attention_xla(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    kept_blocks: jax.Array,
    kept_counts: jax.Array,
    lengths: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """See the package docstring."""
    check_inputs(q, k_pages, v_pages, page_table, kept_blocks, kept_counts, lengths)
    b, h, hd = q.shape
    _, kvh, ps, _ = k_pages.shape
    g = h // kvh
    k = kept_blocks.shape[-1]
    chunk = min(LOOP_BLOCKS, k)
    padded = -(-k // chunk) * chunk
    # Pad the table to whole chunks with a valid column; the count masks the padding.
    kept = jnp.pad(kept_blocks, ((0, 0), (0, 0), (0, padded - k)), mode="edge")
    physical = jnp.take_along_axis(page_table[:, None, :], kept, axis=2)  # [B, 1|KVH, Kp]
    shared = kept_blocks.shape[1] == 1
    heads = jnp.arange(kvh)[None, :, None]
    qg = q.reshape(b, kvh, g, 1, 1, hd).astype(jnp.float32) * hd**-0.5
    counts = kept_counts[..., None, None]  # [B, 1|KVH, 1, 1]
    slot_offsets = jnp.arange(chunk)[None, None, :, None]

    def body(i, carry):
        best, norm, acc, block_lse = carry  # [B,KVH,G], same, [B,KVH,G,hd], [B,KVH,G,Kp]
        start = i * chunk
        cols = jax.lax.dynamic_slice_in_dim(kept, start, chunk, axis=2)  # [B, 1|KVH, C]
        pages = jax.lax.dynamic_slice_in_dim(physical, start, chunk, axis=2)
        if shared:
            keys = k_pages[pages[:, 0]].transpose(0, 2, 1, 3, 4)  # [B, KVH, C, ps, hd]
            values = v_pages[pages[:, 0]].transpose(0, 2, 1, 3, 4)
        else:
            keys = k_pages[pages, heads]  # [B, KVH, C, ps, hd]
            values = v_pages[pages, heads]
        positions = cols[..., None] * ps + jnp.arange(ps)  # [B, 1|KVH, C, ps]
        valid = (positions < lengths[:, None, None, None]) & (start + slot_offsets < counts)
        valid = valid[:, :, None]  # [B, 1|KVH, 1, C, ps]
        scores = jnp.sum(qg * keys[:, :, None].astype(jnp.float32), axis=-1)
        scores = jnp.where(valid, scores, _MASKED)  # [B, KVH, G, C, ps]
        block_best = scores.max(axis=-1)  # [B, KVH, G, C]
        new_best = jnp.maximum(best, block_best.max(axis=-1))
        rescale = jnp.exp(best - new_best)
        weights = jnp.where(valid, jnp.exp(scores - new_best[..., None, None]), 0.0)
        block_sum = weights.sum(axis=-1)  # [B, KVH, G, C], relative to new_best
        lse = jnp.where(block_sum > 0, new_best[..., None] + jnp.log(block_sum), _MASKED)
        part = jnp.sum(weights[..., None] * values[:, :, None].astype(jnp.float32), axis=(3, 4))
        return (
            new_best,
            norm * rescale + block_sum.sum(axis=-1),
            acc * rescale[..., None] + part,
            jax.lax.dynamic_update_slice_in_dim(block_lse, lse, start, axis=3),
        )

    init = (
        jnp.full((b, kvh, g), _MASKED, jnp.float32),
        jnp.zeros((b, kvh, g), jnp.float32),
        jnp.zeros((b, kvh, g, hd), jnp.float32),
        jnp.full((b, kvh, g, padded), _MASKED, jnp.float32),
    )
    trips = (jnp.max(kept_counts) + chunk - 1) // chunk
    best, norm, acc, block_lse = jax.lax.fori_loop(0, trips, body, init)
    has_keys = norm > 0
    out = acc / jnp.where(has_keys, norm, 1.0)[..., None]
    total = jnp.where(has_keys, best + jnp.log(jnp.where(has_keys, norm, 1.0)), 0.0)
    probs = jnp.where(has_keys[..., None], jnp.exp(block_lse - total[..., None]), 0.0)
    block_mass = probs.mean(axis=2)[..., :k]  # [B, KVH, K]
    return out.reshape(b, h, hd).astype(q.dtype), block_mass
