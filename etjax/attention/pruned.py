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
from etjax.pruning.block_scores import remember_mass
from etjax.pruning.config import PruningShape, PruningThresholds
from etjax.pruning.groups import PrunedGroups, select_grouped


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
