"""Block-sparse paged decode attention as a Pallas GPU (Triton) kernel.

Grid (batch, kv_head): one program walks its row's kept blocks with a loop whose trip count is
the kept count, loading each kept [page_size, head_dim] tile of K and V straight from the page
pool by its page id, so dropped pages are never read. Online softmax in registers; each block's
log-sum-exp is stored for the per-block mass. Query heads of a group are padded to a power of
two (Triton block shapes must be powers of two); products are broadcast-multiply-reduce because
a decode group is far below the 16 rows `tl.dot` needs. Runs on CPU with `interpret=True`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.block_sparse.pallas_tpu import block_mass_from_lse
from pallas_kernels.block_sparse.validation import check_inputs, per_head


def _next_power_of_two(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


def _kernel(
    q_ref,  # [G, hd]
    table_ref,  # [P]
    kept_ref,  # [K]
    count_ref,  # [1]
    length_ref,  # [1]
    k_pages_ref,  # [N, KVH, ps, hd] the whole pool, indexed by page id
    v_pages_ref,
    out_ref,  # [G, hd]
    lse_ref,  # [K, G]
    *,
    scale: float,
    page_size: int,
):
    h = pl.program_id(1)
    q = q_ref[...].astype(jnp.float32)
    group, hd = q.shape
    length = length_ref[0]
    lse_ref[...] = jnp.full(lse_ref.shape, -jnp.inf, jnp.float32)

    def body(j, carry):
        m_prev, l_prev, acc = carry
        block = kept_ref[j]
        page = table_ref[block]
        k = k_pages_ref[page, h].astype(jnp.float32)  # [ps, hd]
        v = v_pages_ref[page, h].astype(jnp.float32)
        s = jnp.sum(q[:, None, :] * k[None, :, :], axis=-1) * scale  # [G, ps]
        positions = block * page_size + jnp.arange(page_size)[None, :]
        s = jnp.where(positions < length, s, -jnp.inf)
        block_max = jnp.max(s, axis=1)
        safe_block_max = jnp.where(block_max > -jnp.inf, block_max, 0.0)
        block_sum = jnp.sum(jnp.exp(s - safe_block_max[:, None]), axis=1)
        lse_ref[j, :] = safe_block_max + jnp.log(block_sum)
        m_new = jnp.maximum(m_prev, block_max)
        safe_m = jnp.where(m_new > -jnp.inf, m_new, 0.0)
        alpha = jnp.exp(m_prev - safe_m)
        p = jnp.exp(s - safe_m[:, None])
        acc = alpha[:, None] * acc + jnp.sum(p[:, :, None] * v[None, :, :], axis=1)
        return m_new, alpha * l_prev + jnp.sum(p, axis=1), acc

    init = (
        jnp.full((group,), -jnp.inf, jnp.float32),
        jnp.zeros((group,), jnp.float32),
        jnp.zeros((group, hd), jnp.float32),
    )
    _, total, acc = jax.lax.fori_loop(0, count_ref[0], body, init)
    out_ref[...] = (acc / jnp.where(total > 0, total, 1.0)[:, None]).astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret", "num_warps"))
def block_sparse_attention_gpu(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    kept_blocks: jax.Array,
    kept_counts: jax.Array,
    lengths: jax.Array,
    interpret: bool = False,
    num_warps: int = 4,
) -> tuple[jax.Array, jax.Array]:
    """See the package docstring; `interpret=True` runs the kernel on any backend."""
    from jax.experimental.pallas import triton as plgpu

    check_inputs(q, k_pages, v_pages, page_table, kept_blocks, kept_counts, lengths)
    kept_blocks, kept_counts = per_head(kept_blocks, kept_counts, k_pages.shape[1])
    b, h, hd = q.shape
    _, kvh, ps, _ = k_pages.shape
    p_width = page_table.shape[1]
    group = h // kvh
    group_pad = _next_power_of_two(group)
    num_kept = kept_blocks.shape[-1]
    kept_pad = _next_power_of_two(num_kept)
    q_grouped = q.reshape(b, kvh, group, hd)
    if group_pad != group:
        q_grouped = jnp.pad(q_grouped, ((0, 0), (0, 0), (0, group_pad - group), (0, 0)))
    kept = kept_blocks.astype(jnp.int32)
    if kept_pad != num_kept:
        kept = jnp.pad(kept, ((0, 0), (0, 0), (0, kept_pad - num_kept)))
    table = page_table.astype(jnp.int32)
    p_pad = _next_power_of_two(p_width)
    if p_pad != p_width:
        table = jnp.pad(table, ((0, 0), (0, p_pad - p_width)))

    kernel = functools.partial(_kernel, scale=hd**-0.5, page_size=ps)
    out, block_lse = pl.pallas_call(
        kernel,
        grid=(b, kvh),
        in_specs=[
            pl.BlockSpec((None, None, group_pad, hd), lambda bi, hi: (bi, hi, 0, 0)),
            pl.BlockSpec((None, p_pad), lambda bi, hi: (bi, 0)),
            pl.BlockSpec((None, None, kept_pad), lambda bi, hi: (bi, hi, 0)),
            pl.BlockSpec((None, None, 1), lambda bi, hi: (bi, hi, 0)),
            pl.BlockSpec((None, 1), lambda bi, hi: (bi, 0)),
            # The whole pool as one block: the kernel indexes it by page id, loading one
            # [page_size, head_dim] tile at a time (the shape Triton needs to be a power of two).
            pl.BlockSpec(k_pages.shape, lambda bi, hi: (0, 0, 0, 0)),
            pl.BlockSpec(v_pages.shape, lambda bi, hi: (0, 0, 0, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, group_pad, hd), lambda bi, hi: (bi, hi, 0, 0)),
            pl.BlockSpec((None, None, kept_pad, group_pad), lambda bi, hi: (bi, hi, 0, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, kvh, group_pad, hd), q.dtype),
            jax.ShapeDtypeStruct((b, kvh, kept_pad, group_pad), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
    )(
        q_grouped,
        table,
        kept,
        kept_counts.astype(jnp.int32)[..., None],
        lengths.astype(jnp.int32)[:, None],
        k_pages,
        v_pages,
    )
    out = out[:, :, :group].reshape(b, h, hd)
    block_lse = block_lse[:, :, :num_kept, :group]
    return out, block_mass_from_lse(block_lse)
