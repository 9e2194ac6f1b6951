"""Pruned decode attention: the blocks a token reads, and the kernel that reads them.

Per layer, one decode token per row scores every page of its sequence with the Quest bound
(the largest q.k the page's per-dimension key bounds allow, etjax/pruning/block_scores.py),
keeps its budget of blocks (sinks, the recent window, recently hot pages, then the best
scored: etjax/pruning/selection.py) and attends to those only, with the block-sparse kernel
of the chosen backend (pallas_kernels/block_sparse/). The attention mass each kept page drew
is remembered for the next step's selection.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from etjax.cache.kv_cache import PagePool
from etjax.pruning.block_scores import block_upper_bounds, remember_mass
from etjax.pruning.config import PruningConfig
from etjax.pruning.selection import select_blocks
from pallas_kernels.block_sparse import block_sparse_attention_xla


def pruned_decode_attention(
    q: jax.Array,
    pool: PagePool,
    position: jax.Array,
    real: jax.Array,
    page_table: jax.Array,
    budget_blocks: jax.Array,
    pruning: PruningConfig,
    max_kept: int,
    backend: str = "xla",
) -> tuple[jax.Array, PagePool]:
    """q: [B, H, hd], one decode token per row at `position` [B] (its key already written);
    real: [B] bool rows whose token is real; page_table: [B, P] the rows' pages as pool pages
    (this layer's); budget_blocks: [B] int32
    blocks each row may read; max_kept: static width of the kept table; backend: "xla",
    "pallas_tpu" or "pallas_gpu" (etjax/attention/seam.py). Returns [B, H, hd] and the pool
    with the remembered block mass updated."""
    page_size = pool.k.shape[2]
    lengths = position + 1
    num_blocks = (lengths + page_size - 1) // page_size
    scores = block_upper_bounds(q, pool.k_min, pool.k_max, page_table)  # [B, KVH, P]
    last_mass = pool.block_mass[page_table].transpose(0, 2, 1)  # [B, KVH, P]
    if pruning.share_heads:
        scores = scores.max(axis=1, keepdims=True)
        last_mass = last_mass.max(axis=1, keepdims=True)
    kept, counts = select_blocks(scores, num_blocks, budget_blocks, pruning, max_kept, last_mass)
    kernel = _block_sparse_kernel(backend)
    out, mass = kernel(q, pool.k, pool.v, page_table, kept, counts, lengths)
    if pruning.mass_threshold > 0:
        physical = jnp.take_along_axis(page_table[:, None, :], kept, axis=2)
        pool = pool.replace(block_mass=remember_mass(pool.block_mass, physical, mass, counts, real))
    return out, pool


def _block_sparse_kernel(backend: str):
    # A Pallas kernel asked for on the CPU runs in interpret mode: slow, but the same program,
    # which is how the tests drive the product path through every backend.
    interpret = jax.default_backend() == "cpu"
    if backend == "xla":
        return block_sparse_attention_xla
    if backend == "pallas_tpu":
        from pallas_kernels.block_sparse.pallas_tpu import block_sparse_attention_tpu

        return functools.partial(block_sparse_attention_tpu, interpret=interpret)
    if backend == "pallas_gpu":
        from pallas_kernels.block_sparse.pallas_gpu import block_sparse_attention_gpu

        return functools.partial(block_sparse_attention_gpu, interpret=interpret)
    raise ValueError(f"attention backend {backend!r}; expected xla, pallas_tpu or pallas_gpu")
