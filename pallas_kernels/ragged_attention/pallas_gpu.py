"""Ragged paged attention as a Pallas GPU (Triton) kernel: the semantics of `ragged_attention_xla`.

Per pass, one program per (query tile, block of query rows, split of the tile's items). A tile's
rows for one KV head are its tokens times the G query heads sharing that head, token-major
([Qt * G, hd]); they are cut into blocks of at most 64 rows (a power of two, padded with rows at
position -1 that see nothing), so a decode tile is one block of G rows padded to 4 and a 64-token
prefill tile of SmolLM2 (G = 3) is three full blocks, never padded to 256. The program walks its
share of the tile's items with a loop whose bounds are traced, loading each item's `kv_tile`
[page_size, head_dim] key and value pages straight from the pool by page id, so a token reads
its own sequence's pages only. The item's pages are scored first and the softmax is rescaled
once per item (not per page). Masked scores take a large finite negative and their weights are
zeroed, as in the XLA backend, so rows that see nothing stay at zero and never produce NaN.

Splitting a tile's items over several programs (flash-decoding) is what keeps the GPU busy:
a decode pass of 8 rows has only 8 x 3 (tile, KV head) pairs, far fewer than an H200's 132 SMs,
and each would otherwise walk a 32K context alone. Each split writes float32 partials
(running max, normaliser, weighted values) and the wrapper merges them, a [.., splits, rows, hd]
reduction that is small beside the pages read. `num_splits=None` picks enough splits for about
`_TARGET_PROGRAMS` programs, at most the item capacity per tile; that target is a guess for
H100/H200-class GPUs, not a measurement. A split with no items exits after two scalar loads.

Items of a tile must be consecutive in the item list (build_pass appends each tile's items
together): the wrapper finds each tile's [first, first + count) with a scatter over the items.
`chunk` is accepted for the XLA backend's signature and ignored: it sets how many items that
backend gathers per loop trip, while here each program loads one item at a time.

Triton constraints (compiled mode): every loaded or stored block is a power of two (row blocks,
page_size and head_dim; the latter two are checked); `tl.dot` needs every dimension >= 16, so
row blocks of fewer than 16 rows (decode) or pages of fewer than 16 keys use broadcast
multiply-and-sum, as pallas_kernels/block_sparse/pallas_gpu.py does for decode groups; larger
blocks use `dot_general` with HIGHEST precision (exact float32, not TF32, for float32 inputs;
bfloat16 inputs multiply in bfloat16 with float32 accumulation, and the weights of the
weights-by-values product are rounded to the values' dtype, as in flash attention).

Verified only in interpret mode on CPU (tests/test_ragged_attention_gpu.py): it has not been
compiled by Triton or timed on a GPU; benchmarks/gpu_check.sh does both where a GPU is present.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.ragged_attention.work_items import TilePass

_MASKED = -1e30
# A block's float32 accumulator is rows x head_dim: 64 x 64 is 16 KB of registers, the usual
# flash-attention block for 4 warps; more rows per program would spill.
_MAX_ROWS = 64
# About two programs per SM of an H100/H200 (132 SMs); unmeasured.
_TARGET_PROGRAMS = 256
_DOT_MIN = 16  # tl.dot's smallest dimension


def _next_power_of_two(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


def _kernel(
    window_ref,  # [1] sliding window in positions (0: none)
    first_ref,  # [Nq] first item of each tile
    count_ref,  # [Nq] items of each tile
    item_pages_ref,  # [W, Kt] physical pages of each item
    key_start_ref,  # [W] position of each item's first key
    q_ref,  # [R, hd] this block's query rows
    pos_ref,  # [R] their positions (-1: padding)
    k_pages_ref,  # [N, KVH, ps, hd] the whole pool, indexed by page id
    v_pages_ref,
    acc_ref,  # [R, hd] float32 weighted values of this split
    best_ref,  # [R] float32 running max of this split
    norm_ref,  # [R] float32 normaliser of this split
    *,
    scale: float,
    softcap: float,
    page_size: int,
    kv_tile: int,
    row_blocks: int,
    num_splits: int,
    use_dot: bool,
):
    tile = pl.program_id(0)
    head = pl.program_id(1) // row_blocks
    split = pl.program_id(2)
    first, count = first_ref[tile], count_ref[tile]
    share = (count + num_splits - 1) // num_splits
    lo = first + jnp.minimum(split * share, count)
    hi = first + jnp.minimum((split + 1) * share, count)
    q = q_ref[...]
    positions = pos_ref[...]
    window = window_ref[0]
    # Keys at or before this position are hidden by the window (never, without one).
    hidden_to = jnp.where(window > 0, positions - window, -1)
    rows, hd = q.shape
    offsets = jnp.arange(page_size, dtype=jnp.int32)

    def scores_of(k):  # [ps, hd] -> [R, ps] float32
        if use_dot:
            dtype = jnp.promote_types(q.dtype, k.dtype)
            return jax.lax.dot_general(
                q.astype(dtype),
                k.astype(dtype),
                (((1,), (1,)), ((), ())),
                precision=jax.lax.Precision.HIGHEST,
                preferred_element_type=jnp.float32,
            )
        qf, kf = q.astype(jnp.float32), k.astype(jnp.float32)
        return jnp.sum(qf[:, None, :] * kf[None, :, :], axis=-1)

    def weighted(p, v):  # [R, ps] float32, [ps, hd] -> [R, hd] float32
        if use_dot:
            return jax.lax.dot_general(
                p.astype(v.dtype),
                v,
                (((1,), (0,)), ((), ())),
                precision=jax.lax.Precision.HIGHEST,
                preferred_element_type=jnp.float32,
            )
        return jnp.sum(p[:, :, None] * v.astype(jnp.float32)[None, :, :], axis=1)

    def body(i, carry):
        best, norm, acc = carry
        key_start = key_start_ref[i]
        pages, scores, visible = [], [], []
        for j in range(kv_tile):  # static: all of an item's pages scored before one rescale
            page = item_pages_ref[i, j]
            key_pos = key_start + j * page_size + offsets
            seen = (key_pos[None, :] <= positions[:, None]) & (
                key_pos[None, :] > hidden_to[:, None]
            )  # [R, ps]
            s = scores_of(k_pages_ref[page, head]) * scale
            if softcap:  # Gemma 2's cap on attention logits (static: no cost without one)
                s = softcap * jnp.tanh(s / softcap)
            pages.append(page)
            scores.append(jnp.where(seen, s, _MASKED))
            visible.append(seen)
        new_best = best
        for s in scores:
            new_best = jnp.maximum(new_best, jnp.max(s, axis=1))
        rescale = jnp.exp(best - new_best)
        norm = norm * rescale
        acc = acc * rescale[:, None]
        for page, s, seen in zip(pages, scores, visible, strict=True):
            p = jnp.where(seen, jnp.exp(s - new_best[:, None]), 0.0)
            norm = norm + jnp.sum(p, axis=1)
            acc = acc + weighted(p, v_pages_ref[page, head])
        return new_best, norm, acc

    init = (
        jnp.full((rows,), _MASKED, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, hd), jnp.float32),
    )
    best, norm, acc = jax.lax.fori_loop(lo, hi, body, init)
    acc_ref[...] = acc
    best_ref[...] = best
    norm_ref[...] = norm


@functools.partial(jax.jit, static_argnames=("chunk", "interpret", "num_splits", "softcap"))
def ragged_attention_gpu(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    q_positions: jax.Array,
    passes: tuple[TilePass, ...],
    chunk: int = 16,
    *,
    interpret: bool = False,
    num_splits: int | None = None,
    window: jax.Array | int = 0,
    softcap: float = 0.0,
) -> jax.Array:
    """q: [T, H, hd]; k_pages, v_pages: [N, KVH, ps, hd]; q_positions: [T] int32; `passes`
    together cover every real token once (work_items.py). Returns [T, H, hd] in q's dtype;
    tokens in no tile get zeros. `chunk` is ignored (module docstring); `num_splits` programs
    share each tile's items (None: enough for about 256 programs per pass); `interpret=True`
    runs the kernel on any backend; window: a sliding window in positions (0: none), as in
    the XLA backend; softcap: Gemma 2's cap on scores, as in the XLA backend (0: none)."""
    t, h, hd = q.shape
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages {k_pages.shape} and v_pages {v_pages.shape} must match")
    _, kvh, ps, khd = k_pages.shape
    if khd != hd or h % kvh:
        raise ValueError(f"q {q.shape} does not fit pages {k_pages.shape}")
    for name, size in (("page_size", ps), ("head_dim", hd)):
        if size != _next_power_of_two(size):
            raise ValueError(f"{name} {size} must be a power of two (Triton block shapes)")
    del chunk
    out = jnp.zeros((t, h, hd), jnp.float32)
    for tile_pass in passes:
        part = _run_pass(
            q, k_pages, v_pages, q_positions, tile_pass, interpret, num_splits, window, softcap
        )
        tokens = jnp.asarray(tile_pass.tile_tokens).reshape(-1)
        out = out.at[tokens].add(part.reshape(-1, h, hd), mode="drop")
    return out.astype(q.dtype)


def _run_pass(
    q, k_pages, v_pages, q_positions, tile_pass, interpret, num_splits, window, softcap
) -> jax.Array:
    # -> [Nq, Qt, H, hd] float32
    from jax.experimental.pallas import triton as plgpu

    _, h, hd = q.shape
    _, kvh, ps, _ = k_pages.shape
    g = h // kvh
    tile_tokens, item_tile, item_pages, item_key_start, num_items = map(jnp.asarray, tile_pass)
    nq, qt = tile_tokens.shape
    w, kt = item_pages.shape
    # Each tile's items: [first, first + count), consecutive by build_pass's construction.
    index = jnp.arange(w, dtype=jnp.int32)
    real = index < num_items
    count = jnp.zeros(nq, jnp.int32).at[item_tile].add(real.astype(jnp.int32))
    first = jnp.full(nq, w, jnp.int32).at[item_tile].min(jnp.where(real, index, w))

    # Rows of (tile, KV head): Qt tokens x G heads, token-major, cut into blocks of R rows.
    num_rows = qt * g
    block = min(_next_power_of_two(num_rows), _MAX_ROWS)
    row_blocks = -(-num_rows // block)
    pad = row_blocks * block - num_rows
    queries = q.at[tile_tokens].get(mode="fill", fill_value=0)  # [Nq, Qt, H, hd]
    queries = queries.reshape(nq, qt, kvh, g, hd).transpose(0, 2, 1, 3, 4)
    queries = jnp.pad(queries.reshape(nq, kvh, num_rows, hd), ((0, 0), (0, 0), (0, pad), (0, 0)))
    queries = queries.reshape(nq, kvh * row_blocks, block, hd)
    positions = q_positions.astype(jnp.int32).at[tile_tokens].get(mode="fill", fill_value=-1)
    positions = jnp.pad(jnp.repeat(positions, g, axis=1), ((0, 0), (0, pad)), constant_values=-1)
    positions = jnp.broadcast_to(positions[:, None], (nq, kvh, row_blocks * block))
    positions = positions.reshape(nq, kvh * row_blocks, block)

    programs = nq * kvh * row_blocks
    if num_splits is None:
        num_splits = max(1, min(-(-_TARGET_PROGRAMS // programs), w // max(nq, 1)))
    use_dot = min(block, ps, hd) >= _DOT_MIN
    kernel = functools.partial(
        _kernel,
        scale=hd**-0.5,
        softcap=softcap,
        page_size=ps,
        kv_tile=kt,
        row_blocks=row_blocks,
        num_splits=num_splits,
        use_dot=use_dot,
    )
    whole = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))  # noqa: E731
    rows_spec = pl.BlockSpec((None, None, block, hd), lambda i, r, s: (i, r, 0, 0))
    split_spec = pl.BlockSpec((None, None, None, block, hd), lambda i, r, s: (i, r, s, 0, 0))
    stat_spec = pl.BlockSpec((None, None, None, block), lambda i, r, s: (i, r, s, 0))
    stat_shape = jax.ShapeDtypeStruct((nq, kvh * row_blocks, num_splits, block), jnp.float32)
    acc, best, norm = pl.pallas_call(
        kernel,
        grid=(nq, kvh * row_blocks, num_splits),
        in_specs=[
            whole((1,)),
            whole((nq,)),
            whole((nq,)),
            whole((w, kt)),
            whole((w,)),
            rows_spec,
            pl.BlockSpec((None, None, block), lambda i, r, s: (i, r, 0)),
            # The whole pool as one block: the kernel loads one [page_size, head_dim] tile of a
            # page and head at a time.
            whole(k_pages.shape),
            whole(v_pages.shape),
        ],
        out_specs=[split_spec, stat_spec, stat_spec],
        out_shape=[
            jax.ShapeDtypeStruct((nq, kvh * row_blocks, num_splits, block, hd), jnp.float32),
            stat_shape,
            stat_shape,
        ],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
    )(
        jnp.asarray(window, jnp.int32).reshape(1),
        first,
        count,
        item_pages.astype(jnp.int32),
        item_key_start.astype(jnp.int32),
        queries,
        positions,
        k_pages,
        v_pages,
    )
    # Merge the splits' partial softmaxes; empty splits have norm 0 and acc 0.
    top = jnp.max(best, axis=2, keepdims=True)
    weight = jnp.exp(best - top)
    norm = jnp.sum(weight * norm, axis=2)
    acc = jnp.sum(weight[..., None] * acc, axis=2)
    out = acc / jnp.where(norm > 0, norm, 1.0)[..., None]  # [Nq, KVH * blocks, R, hd]
    out = out.reshape(nq, kvh, row_blocks * block, hd)[:, :, :num_rows]
    out = out.reshape(nq, kvh, qt, g, hd).transpose(0, 2, 1, 3, 4)
    return out.reshape(nq, qt, h, hd)
