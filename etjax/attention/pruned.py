"""Pruned decode attention: the blocks a token reads, and the kernel that reads them.

Per layer, one decode token per row scores every page of its sequence with the Quest bound
(the largest q.k the page's per-dimension key bounds allow, etjax/pruning/block_scores.py),
keeps its budget of blocks (sinks, the recent window, recently hot pages, then the best
scored: etjax/pruning/selection.py) and attends to those only, with the block-sparse kernel
of the chosen backend (pallas_kernels/block_sparse/). The attention mass each kept page drew
is remembered for the next step's selection.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from etjax.attention.backend import XLA, AttentionBackend
from etjax.cache.kv_cache import PagePool
from etjax.pruning.block_scores import block_upper_bounds, remember_mass
from etjax.pruning.config import PruningShape, PruningThresholds
from etjax.pruning.groups import PrunedGroups, select_grouped

# Pages scored per loop trip (see score_pages_xla).
SCORE_PAGES = 32


def pruned_decode_attention(
    q: jax.Array,
    pool: PagePool,
    position: jax.Array,
    real: jax.Array,
    page_table: jax.Array,
    budget_blocks: jax.Array,
    pruning: PruningShape,
    thresholds: PruningThresholds,
    max_kept: int,
    backend: AttentionBackend = XLA,
    mass_rows: jax.Array | None = None,
    groups: PrunedGroups | None = None,
    fraction: jax.Array | None = None,
) -> tuple[jax.Array, PagePool]:
    """q: [B, H, hd], one decode token per row at `position` [B] (its key already written);
    real: [B] bool rows whose token is real; page_table: [B, P] the rows' pages as pool pages
    (this layer's); mass_rows: [B] int32 each row's row of the pool's block mass (this
    layer's; needed when `pruning.ranks_by_mass`); budget_blocks: [B] int32
    blocks each row may read; pruning, thresholds: the static settings and the traced numbers
    of the selection (etjax/pruning/config.py); max_kept: static width of the kept table;
    backend: whose block-sparse kernel reads the kept blocks (etjax/attention/backend.py);
    groups: rows sharing a prefix, which select its blocks together and read them once
    (etjax/pruning/groups.py; only where `backend.reads_grouped_pruned_rows`), with
    `fraction` [B] the rows' kept fractions their budgets come from.
    Returns [B, H, hd] and the pool with the remembered block mass updated."""
    page_size = pool.k.shape[2]
    lengths = position + 1
    num_blocks = (lengths + page_size - 1) // page_size
    scores = backend.page_bounds()(
        q, pool.k_min, pool.k_max, page_table, num_blocks, pruning.share_heads
    )
    ranking_mass = None
    if pruning.ranks_by_mass:
        ranking_mass = _last_mass(pool.block_mass, mass_rows, page_table.shape[1])
        if pruning.share_heads:
            ranking_mass = ranking_mass.max(axis=1, keepdims=True)
    kernel = backend.block_sparse()
    if groups is None:
        kept, counts = backend.block_selection()(
            scores, num_blocks, budget_blocks, thresholds, max_kept, ranking_mass
        )
        out, mass = kernel(q, pool.k, pool.v, page_table, kept, counts, lengths)
    else:
        if not backend.reads_grouped_pruned_rows:
            raise ValueError(f"the {backend.name} block-sparse kernel cannot read groups")
        kept, counts, shared_counts = select_grouped(
            backend.block_selection(),
            scores,
            num_blocks,
            fraction,
            groups,
            thresholds,
            max_kept,
            ranking_mass,
        )
        out, mass = kernel(
            q, pool.k, pool.v, page_table, kept, counts, lengths, groups.leaders, shared_counts
        )
    if pruning.ranks_by_mass:
        remembered = remember_mass(pool.block_mass, mass_rows, kept, mass, counts, real)
        pool = pool.replace(block_mass=remembered)
    return out, pool


def _last_mass(block_mass: jax.Array, mass_rows: jax.Array, width: int) -> jax.Array:
    # The mass each of the rows' first `width` blocks drew when last read: [B, KVH, width]
    # (zeros past the memory's width: blocks it never held count as never read).
    last = block_mass[mass_rows].transpose(0, 2, 1)  # [B, KVH, W]
    if last.shape[2] >= width:
        return last[..., :width]
    return jnp.pad(last, ((0, 0), (0, 0), (0, width - last.shape[2])))


def kept_table_width(backend: AttentionBackend, needed: int, width: int) -> int:
    """Static width of the kept-block table for a page table `width` wide when the largest
    budget of the step keeps `needed` blocks. The XLA and Triton kernels loop up to the kept
    count (a traced value), so padding costs them nothing: the table is the page table's
    width and the step compiles once. The TPU kernel's grid is static and each step past the
    count still costs a grid step, so its table is rounded to an eighth of the width (at most
    eight programs per width)."""
    if backend.name != "pallas_tpu":
        return width
    step = max(4, width // 8)
    return min(width, -(-max(needed, 1) // step) * step)


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
