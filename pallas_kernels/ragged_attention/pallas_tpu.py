"""One pass of ragged paged attention as a Pallas TPU (Mosaic) kernel, reading pages in place.

It takes the XLA backend's passes (work_items.py) and returns what its loops return (the
tiles' outputs and log-sum-exps), so xla.py runs it in their place (`native_pass`) for the
`pallas_tpu` attention backend, with the same shared-prefix merge, windows and soft cap.

One program per query tile, KV head and block of the tile's rows for that head (its tokens
times the G query heads sharing it, token-major, at most `MAX_ROWS` a block): the rows stay
in VMEM while a loop walks the tile's items (consecutive in the item list, as build_pass lays
them out), a traced count. Each item's `kv_tile` pages stay in HBM (`memory_space=ANY`) and
are copied by hand, one [page_size, head_dim] tile per page, end to end into a two-slot VMEM
buffer ([kv_tile * page_size, head_dim] a slot, so an item is one product): the next item's
copies start before the current item is scored, so the DMA of item i + 1 overlaps the
products of item i. An online softmax (max, normaliser, weighted values, float32) runs in
VMEM scratch. So the KV a pass reads is each tile's own pages, once a row block, with
nothing written back: a decode row (one block) reads its KV once a layer, where the XLA
kernel's gather reads it, writes a contiguous copy and reads that.

The grid has tiles x KV heads x row blocks programs (a decode pass of 64 rows of Llama-3:
512), not one per page: a grid step costs a fixed overhead on a TPU that a one-page step (4
KB of keys) would not amortise.

Masked scores take a large finite negative and their weights are zeroed, as in the XLA
backend, so a row that sees nothing stays at zero (its log-sum-exp the same negative).
Runs on any backend with `interpret=True` (the tests do, on a CPU). Float16 pages, which
Mosaic does not load, are refused on a TPU before a step is built (etjax/engine/device.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.ragged_attention.work_items import TilePass

_MASKED = -1e30
# Rows of a program: a 512-token prefill tile of Llama-3 (4 query heads a KV head) is four
# blocks. A block's float32 scores against a long prefill item (32 pages of 16) are 1 MB, its
# accumulator, outputs and row state under 1 MB more: within the 16 MB of VMEM Mosaic lets a
# kernel take by default on a v5e. A whole tile of 1,024 rows against 32 pages asked 48 MB
# (scores a page apart, each padded to 128 lanes) and failed to compile.
MAX_ROWS = 512


def _kernel(
    window_ref,  # [1] sliding window in positions (0: none)  (scalar prefetch, SMEM)
    first_ref,  # [Nq] each tile's first item
    count_ref,  # [Nq] each tile's items
    pages_ref,  # [W * Kt] physical pages of the items, item-major
    key_start_ref,  # [W] position of each item's first key
    q_ref,  # [R, hd] a block of the tile's rows for this KV head
    pos_ref,  # [R, 1] their positions (-1: padding, sees nothing)
    k_hbm,  # [N, KVH, ps, hd] the pool, in HBM
    v_hbm,
    out_ref,  # [R, hd] float32
    lse_ref,  # [R, 1] float32
    k_buf,  # [2, Kt * ps, hd] VMEM, two slots of an item's keys, page after page
    v_buf,
    sems,  # DMA semaphores [2 slots, keys | values]
    best_ref,  # [R, 1] float32
    norm_ref,  # [R, 1] float32
    acc_ref,  # [R, hd] float32
    *,
    scale: float,
    softcap: float,
    page_size: int,
    kv_tile: int,
):
    tile, head = pl.program_id(0), pl.program_id(1)
    first, count = first_ref[tile], count_ref[tile]

    def copies(item, slot):
        # The item's pages for this head, one [ps, hd] tile each, keys and values, laid end
        # to end in the slot: [Kt * ps, hd], one product per item.
        out = []
        for j in range(kv_tile):
            page, rows = pages_ref[item * kv_tile + j], pl.ds(j * page_size, page_size)
            for side, (pool, buf) in enumerate(((k_hbm, k_buf), (v_hbm, v_buf))):
                target = buf.at[slot, rows]
                out.append(pltpu.make_async_copy(pool.at[page, head], target, sems.at[slot, side]))
        return out

    best_ref[...] = jnp.full(best_ref.shape, _MASKED, jnp.float32)
    norm_ref[...] = jnp.zeros(norm_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(count > 0)
    def _first_copies():
        for copy in copies(first, 0):
            copy.start()

    q = q_ref[...].astype(jnp.float32)
    positions = pos_ref[...]  # [R, 1]
    window = window_ref[0]
    offsets = jax.lax.broadcasted_iota(jnp.int32, (1, kv_tile * page_size), 1)

    def body(n, carry):
        item, slot = first + n, n % 2
        for copy in copies(item, slot):
            copy.wait()

        @pl.when(n + 1 < count)
        def _next_copies():  # the next item's pages arrive while this one is scored
            for copy in copies(item + 1, 1 - slot):
                copy.start()

        k = k_buf[slot].astype(jnp.float32)  # [Kt * ps, hd]
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ()))) * scale  # [R, Kt * ps]
        if softcap:  # Gemma 2's cap on attention logits (static: no cost without one)
            s = softcap * jnp.tanh(s / softcap)
        key_pos = key_start_ref[item] + offsets
        visible = (key_pos <= positions) & ((window <= 0) | (key_pos > positions - window))
        s = jnp.where(visible, s, _MASKED)
        best = best_ref[...]
        new_best = jnp.maximum(best, jnp.max(s, axis=1, keepdims=True))
        rescale = jnp.exp(best - new_best)
        p = jnp.where(visible, jnp.exp(s - new_best), 0.0)
        norm_ref[...] = norm_ref[...] * rescale + jnp.sum(p, axis=1, keepdims=True)
        v = v_buf[slot].astype(jnp.float32)
        acc_ref[...] = acc_ref[...] * rescale + jax.lax.dot_general(p, v, (((1,), (0,)), ((), ())))
        best_ref[...] = new_best
        return carry

    jax.lax.fori_loop(0, count, body, 0)
    norm = norm_ref[...]
    seen = norm > 0
    out_ref[...] = acc_ref[...] / jnp.where(seen, norm, 1.0)
    lse_ref[...] = jnp.where(seen, best_ref[...] + jnp.log(jnp.where(seen, norm, 1.0)), _MASKED)


def ragged_pass_tpu(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    q_positions: jax.Array,
    tile_pass: TilePass,
    window: jax.Array | int,
    softcap: float,
    *,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """One pass of ragged attention on the TPU kernel: q [T, H, hd], pools [N, KVH, ps, hd]
    (bfloat16 or float32 on a TPU), q_positions [T], `tile_pass` as work_items.py builds it
    (each tile's items consecutive); window: a sliding window in positions (0: none);
    softcap: scores s become softcap * tanh(s / softcap) (0: none). Returns the tiles'
    outputs [Nq, Qt, H, hd] and log-sum-exps [Nq, Qt, H], float32, as xla.py's passes do."""
    _, h, hd = q.shape
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages {k_pages.shape} and v_pages {v_pages.shape} must match")
    _, kvh, ps, khd = k_pages.shape
    if khd != hd or h % kvh:
        raise ValueError(f"q {q.shape} does not fit pages {k_pages.shape}")
    g = h // kvh
    tile_tokens, item_tile, item_pages, item_key_start, num_items = map(jnp.asarray, tile_pass)
    nq, qt = tile_tokens.shape
    w, kt = item_pages.shape
    rows = qt * g
    # Rows in blocks of at most MAX_ROWS, each a program reading the tile's pages.
    block = rows if rows <= MAX_ROWS else MAX_ROWS
    row_blocks = -(-rows // block)
    pad = row_blocks * block - rows
    # Each tile's items: [first, first + count), consecutive by build_pass's construction.
    index = jnp.arange(w, dtype=jnp.int32)
    real = index < num_items
    count = jnp.zeros(nq, jnp.int32).at[item_tile].add(real.astype(jnp.int32))
    first = jnp.full(nq, w, jnp.int32).at[item_tile].min(jnp.where(real, index, w))
    first = jnp.where(count > 0, first, 0)
    # The tile's rows per KV head, token-major and padded to whole blocks (padding rows at
    # position -1 see nothing): [Nq, KVH, R, hd]; positions [Nq, R, 1].
    queries = q.at[tile_tokens].get(mode="fill", fill_value=0)
    queries = queries.reshape(nq, qt, kvh, g, hd).transpose(0, 2, 1, 3, 4)
    queries = jnp.pad(queries.reshape(nq, kvh, rows, hd), ((0, 0), (0, 0), (0, pad), (0, 0)))
    positions = q_positions.astype(jnp.int32).at[tile_tokens].get(mode="fill", fill_value=-1)
    positions = jnp.pad(jnp.repeat(positions, g, axis=1), ((0, 0), (0, pad)), constant_values=-1)
    positions = positions[..., None]

    per_head = lambda t, hh, r, *_: (t, hh, r, 0)  # noqa: E731
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(nq, kvh, row_blocks),
        in_specs=[
            pl.BlockSpec((None, None, block, hd), per_head),
            pl.BlockSpec((None, block, 1), lambda t, hh, r, *_: (t, r, 0)),
            pl.BlockSpec(memory_space=pl.ANY),
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        out_specs=[
            pl.BlockSpec((None, None, block, hd), per_head),
            pl.BlockSpec((None, None, block, 1), per_head),
        ],
        scratch_shapes=[
            pltpu.VMEM((2, kt * ps, hd), k_pages.dtype),
            pltpu.VMEM((2, kt * ps, hd), v_pages.dtype),
            pltpu.SemaphoreType.DMA((2, 2)),
            pltpu.VMEM((block, 1), jnp.float32),
            pltpu.VMEM((block, 1), jnp.float32),
            pltpu.VMEM((block, hd), jnp.float32),
        ],
    )
    kernel = functools.partial(
        _kernel, scale=hd**-0.5, softcap=float(softcap), page_size=ps, kv_tile=kt
    )
    out, lse = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[
            jax.ShapeDtypeStruct((nq, kvh, row_blocks * block, hd), jnp.float32),
            jax.ShapeDtypeStruct((nq, kvh, row_blocks * block, 1), jnp.float32),
        ],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel")
        ),
        interpret=interpret,
        name="ragged_attention_tpu",
    )(
        jnp.asarray(window, jnp.int32).reshape(1),
        first,
        count,
        item_pages.astype(jnp.int32).reshape(-1),
        item_key_start.astype(jnp.int32),
        queries,
        positions,
        k_pages,
        v_pages,
    )
    out = out[:, :, :rows].reshape(nq, kvh, qt, g, hd).transpose(0, 2, 1, 3, 4)
    lse = lse[:, :, :rows].reshape(nq, kvh, qt, g).transpose(0, 2, 1, 3)
    return out.reshape(nq, qt, h, hd), lse.reshape(nq, qt, h)
