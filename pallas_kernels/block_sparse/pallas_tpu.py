"""Block-sparse paged decode attention as a Pallas TPU kernel.

Grid (batch, kv_head, kept block). The page ids reach the index maps through scalar prefetch
(`PrefetchScalarGridSpec`), so each grid step DMAs exactly one kept [page_size, head_dim] tile
of K and of V; steps past a row's kept count re-name the last kept page (no new DMA) and skip
their compute. An online softmax accumulates in VMEM scratch across the block axis; each
block's log-sum-exp is kept so the wrapper can turn them into per-block attention mass.
Runs on CPU with `interpret=True` (the tests do). Float16 pages, which Mosaic does not load,
arrive as bfloat16 bits and are widened in the kernel, two rows a 32-bit word (`_float16_rows`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.block_sparse.validation import check_inputs, per_head


def _kernel(
    table_ref,
    kept_ref,
    counts_ref,
    lengths_ref,  # scalar prefetch (SMEM)
    q_ref,
    k_ref,
    v_ref,  # [G, hd], [ps, hd], [ps, hd]
    out_ref,
    lse_ref,  # [G, hd], [K, G]
    m_scratch,
    l_scratch,
    acc_scratch,  # [G, 1], [G, 1], [G, hd] float32
    *,
    scale: float,
    page_size: int,
    num_kept: int,
    packed_float16: bool,
):
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)

    @pl.when(j == 0)
    def _init():
        m_scratch[...] = jnp.full(m_scratch.shape, -jnp.inf, jnp.float32)
        l_scratch[...] = jnp.zeros(l_scratch.shape, jnp.float32)
        acc_scratch[...] = jnp.zeros(acc_scratch.shape, jnp.float32)
        lse_ref[...] = jnp.full(lse_ref.shape, -jnp.inf, jnp.float32)

    @pl.when(j < counts_ref[b, h])
    def _accumulate():
        q = q_ref[...].astype(jnp.float32)
        first = kept_ref[b, h, j] * page_size
        # The tile's keys and values in parts, each with the positions of its rows: the whole
        # tile, or a float16 tile's even and odd rows (`_float16_rows`).
        parts = _tile_parts(k_ref, v_ref, first, page_size, packed_float16)
        scores = []
        for k, _, positions in parts:
            s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ()))) * scale  # [G, rows]
            scores.append(jnp.where(positions[None, :] < lengths_ref[b], s, -jnp.inf))
        block_max = functools.reduce(
            jnp.maximum, [jnp.max(s, axis=1, keepdims=True) for s in scores]
        )
        safe_block_max = jnp.where(jnp.isfinite(block_max), block_max, 0.0)
        block_sum = sum(jnp.sum(jnp.exp(s - safe_block_max), axis=1, keepdims=True) for s in scores)
        lse_ref[pl.ds(j, 1), :] = (safe_block_max + jnp.log(block_sum)).reshape(1, -1)

        m_prev = m_scratch[...]
        m_new = jnp.maximum(m_prev, block_max)
        safe_m = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        alpha = jnp.exp(m_prev - safe_m)
        probs = [jnp.exp(s - safe_m) for s in scores]
        l_scratch[...] = alpha * l_scratch[...] + sum(
            jnp.sum(p, axis=1, keepdims=True) for p in probs
        )
        acc_scratch[...] = alpha * acc_scratch[...] + sum(
            jax.lax.dot_general(p, v, (((1,), (0,)), ((), ())))
            for p, (_, v, _) in zip(probs, parts, strict=True)
        )
        m_scratch[...] = m_new

    @pl.when(j == num_kept - 1)
    def _finish():
        total = l_scratch[...]
        out_ref[...] = (acc_scratch[...] / jnp.where(total > 0, total, 1.0)).astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames="interpret")
def block_sparse_attention_tpu(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    kept_blocks: jax.Array,
    kept_counts: jax.Array,
    lengths: jax.Array,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """See the package docstring; `interpret=True` runs the kernel on any backend."""
    check_inputs(q, k_pages, v_pages, page_table, kept_blocks, kept_counts, lengths)
    kept_blocks, kept_counts = per_head(kept_blocks, kept_counts, k_pages.shape[1])
    b, h, hd = q.shape
    _, kvh, ps, _ = k_pages.shape
    num_kept = kept_blocks.shape[-1]
    group = h // kvh

    def page_index(bi, hi, j, table, kept, counts, lengths):
        # Past the kept count, name the last kept page again: the pipeline skips the DMA.
        last = jnp.maximum(counts[bi, hi] - 1, 0)
        return (table[bi, kept[bi, hi, jnp.minimum(j, last)]], hi, 0, 0)

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(b, kvh, num_kept),
        in_specs=[
            pl.BlockSpec((None, None, group, hd), lambda bi, hi, j, *_: (bi, hi, 0, 0)),
            pl.BlockSpec((None, None, ps, hd), page_index),
            pl.BlockSpec((None, None, ps, hd), page_index),
        ],
        out_specs=[
            pl.BlockSpec((None, None, group, hd), lambda bi, hi, j, *_: (bi, hi, 0, 0)),
            pl.BlockSpec((None, None, num_kept, group), lambda bi, hi, j, *_: (bi, hi, 0, 0)),
        ],
        scratch_shapes=[
            pltpu.VMEM((group, 1), jnp.float32),
            pltpu.VMEM((group, 1), jnp.float32),
            pltpu.VMEM((group, hd), jnp.float32),
        ],
    )
    packed_float16 = k_pages.dtype == jnp.float16
    if packed_float16:  # the same bits as bfloat16, which Mosaic takes (`_float16_rows`)
        if ps % 2:
            raise ValueError(f"float16 pages need an even page size, got {ps}")
        k_pages = jax.lax.bitcast_convert_type(k_pages, jnp.bfloat16)
        v_pages = jax.lax.bitcast_convert_type(v_pages, jnp.bfloat16)
    kernel = functools.partial(
        _kernel,
        scale=hd**-0.5,
        page_size=ps,
        num_kept=num_kept,
        packed_float16=packed_float16,
    )
    out, block_lse = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[
            jax.ShapeDtypeStruct((b, kvh, group, hd), q.dtype),
            jax.ShapeDtypeStruct((b, kvh, num_kept, group), jnp.float32),
        ],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
        interpret=interpret,
    )(
        page_table.astype(jnp.int32),
        kept_blocks.astype(jnp.int32),
        kept_counts.astype(jnp.int32),
        lengths.astype(jnp.int32),
        q.reshape(b, kvh, group, hd),
        k_pages,
        v_pages,
    )
    return out.reshape(b, h, hd), block_mass_from_lse(block_lse)


def _tile_parts(k_ref, v_ref, first, page_size: int, packed_float16: bool) -> list:
    # [(keys [rows, hd], values [rows, hd], positions [rows])] float32, covering the tile.
    rows = jax.lax.broadcasted_iota(jnp.int32, (1, page_size), 1)[0]
    if not packed_float16:
        k, v = k_ref[...].astype(jnp.float32), v_ref[...].astype(jnp.float32)
        return [(k, v, first + rows)]
    k_even, k_odd = _float16_rows(k_ref)
    v_even, v_odd = _float16_rows(v_ref)
    pairs = first + 2 * rows[: page_size // 2]
    return [(k_even, v_even, pairs), (k_odd, v_odd, pairs + 1)]


def _float16_rows(ref) -> tuple[jax.Array, jax.Array]:
    # Mosaic takes no float16 operand ("Invalid vector type for load"; kernel arguments must
    # be bfloat16 or 32-bit), so a float16 tile arrives as the same bits typed bfloat16 and is
    # read here as 32-bit words, each holding two rows of the tile (row 2i in its low half,
    # 2i+1 in its high half, as a 16-bit tile packs its rows), then widened to float32 by hand:
    # exact, zeros, subnormals, infinities and NaNs included. [ps, hd] -> two [ps / 2, hd].
    words = pltpu.bitcast(ref[...], jnp.uint32)
    return _widen_float16(words & 0xFFFF), _widen_float16(words >> 16)


def _widen_float16(bits: jax.Array) -> jax.Array:
    # float16 bits (in uint32) -> float32: rebias the exponent (15 -> 127), widen the mantissa
    # (10 -> 23 bits); exponent 0 is zero or subnormal (mantissa x 2^-24), 31 infinity or NaN.
    sign = (bits & 0x8000) << 16
    exponent = (bits >> 10) & 0x1F
    mantissa = bits & 0x3FF
    normal = sign | ((exponent + 112) << 23) | (mantissa << 13)
    special = sign | 0x7F800000 | (mantissa << 13)
    widened = jax.lax.bitcast_convert_type(jnp.where(exponent == 31, special, normal), jnp.float32)
    small = mantissa.astype(jnp.float32) * 2.0**-24
    small = jnp.where(sign != 0, -small, small)
    return jnp.where(exponent == 0, small, widened)


def block_mass_from_lse(block_lse: jax.Array) -> jax.Array:
    """[B, KVH, K, G] per-block log-sum-exp -> [B, KVH, K] mass averaged over the group."""
    total = jax.nn.logsumexp(block_lse, axis=2, keepdims=True)
    total = jnp.where(jnp.isfinite(total), total, 0.0)
    return jnp.exp(block_lse - total).mean(axis=-1)
