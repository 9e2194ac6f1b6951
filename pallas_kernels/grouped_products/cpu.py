"""Grouped products on the C++ kernel (cpp_kernels/grouped_products.cc): units of (expert
with rows, 32 outputs), so each expert's weights are read once for all its rows and experts
without rows not at all; experts kept in blocks (etjax/model/quantized.py) are read as blocks
and dequantized in registers (block_rows.h, the block products' engine)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from cpp_kernels import call_cpu_kernel, cpu_kernels_available
from cpp_kernels.targets import GROUPED_PRODUCTS
from pallas_kernels.block_products.cpu import MAX_KERNEL_ROWS, block_products_cpu_takes

_FLOATS = (jnp.float32, jnp.float16, jnp.bfloat16)


def grouped_products_cpu_takes(rows: jax.Array, w: jax.Array, group_sizes: jax.Array) -> bool:
    """Whether the kernel takes these shapes: rows [R > 0, K] and weights [E, N, K] of 16 or
    32 bits, group_sizes [E], K a multiple of 16 and N of 4 (grouped_products.cc)."""
    return (
        rows.ndim == 2
        and rows.shape[0] > 0
        and rows.dtype in _FLOATS
        and w.ndim == 3
        and w.dtype in _FLOATS
        and group_sizes.shape == (w.shape[0],)
        and rows.shape[1] == w.shape[2]
        and rows.shape[1] % 16 == 0
        and w.shape[1] % 4 == 0
    )


def grouped_products_cpu(rows: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """The package's signature on the CPU kernel, for the shapes `grouped_products_cpu_takes`
    accepts."""
    # 16-bit rows (a bfloat16 model) are widened for the kernel and its float32 sums rounded
    # back, as XLA's product with a 16-bit result rounds its own: [R, K] and [R, N] are small
    # beside the experts' weights.
    none = jnp.zeros((0,), jnp.float32)
    out = call_cpu_kernel(
        GROUPED_PRODUCTS,
        jax.ShapeDtypeStruct((rows.shape[0], w.shape[1]), jnp.float32),
        rows.astype(jnp.float32),
        w,
        none,
        none,
        group_sizes,
    )
    return out.astype(rows.dtype)


def grouped_blocks_cpu_takes(
    rows: jax.Array,
    quants: jax.Array,
    scales: jax.Array,
    offsets: jax.Array | None,
    block: int,
    bits: int,
    group_sizes: jax.Array,
) -> bool:
    """Whether the kernel takes rows [R, K] times experts kept in blocks: quants [E, N, ...],
    scales [E, N, K // block] and offsets as each expert's weight [N, K] would be taken by the
    block-products kernel (`block_products_cpu_takes`: `K` a multiple of 32, ...), 1 to
    MAX_KERNEL_ROWS rows of float32 or 16 bits (widened), group_sizes [E]."""
    if rows.ndim != 2 or quants.ndim != 3 or scales.ndim != 3 or rows.dtype not in _FLOATS:
        return False
    rows = jax.ShapeDtypeStruct(rows.shape, jnp.float32)
    experts = quants.shape[0]

    def one(a):  # expert 0's array, as a projection's
        return None if a is None else jax.ShapeDtypeStruct(a.shape[1:], a.dtype)

    return (
        0 < rows.shape[0] <= MAX_KERNEL_ROWS
        and group_sizes.shape == (experts,)
        and scales.shape[0] == experts
        and (offsets is None or offsets.shape[0] == experts)
        and block_products_cpu_takes(
            rows, one(quants), one(scales), one(offsets), block, bits, jnp.float32
        )
    )


def grouped_blocks_cpu(
    rows: jax.Array,
    quants: jax.Array,
    scales: jax.Array,
    offsets: jax.Array | None,
    block: int,
    bits: int,
    group_sizes: jax.Array,
) -> jax.Array:
    """rows [R, K] sorted by group times each group's weight kept in blocks -> [R, N] in
    rows' dtype, for the shapes `grouped_blocks_cpu_takes` accepts (`block` and `bits` are
    implied by the arrays' shapes and types). 16-bit rows are widened and the float32 sums
    rounded back, as `grouped_products_cpu` does."""
    del block, bits
    if not cpu_kernels_available():
        raise RuntimeError("the CPU kernels are not built (see the log's warning)")
    # jax.ffi directly, not call_cpu_kernel, which would widen the 8-bit quants to int32.
    out = jax.ffi.ffi_call(
        GROUPED_PRODUCTS.name,
        jax.ShapeDtypeStruct((rows.shape[0], quants.shape[1]), jnp.float32),
    )(
        rows.astype(jnp.float32),
        quants,
        scales,
        jnp.zeros((0,), scales.dtype) if offsets is None else offsets,
        jnp.asarray(group_sizes, jnp.int32),
    )
    return out.astype(rows.dtype)
