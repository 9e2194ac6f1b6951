"""Block products on the C++ kernels: cpp_kernels/block_products.cc (float32 rows: groups of 4
weight rows read once in their blocks and dequantized in registers, every block of input rows
multiplied against them while they sit in L1) and cpp_kernels/int8_rows.cc (rows rounded to
int8 per block of 32, on weights interleaved 16 outputs at a time)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from cpp_kernels import cpu_kernels_available
from cpp_kernels.targets import BLOCK_PRODUCTS, INT8_ROWS

# The most rows the kernel is asked to take: every step of the engine (prompt chunks of 512
# and the decode rows beside them). Its cost grows with the rows as XLA's float32 product's
# does (1.3x that at 256 rows), and the fallback, XLA dequantizing the blocks in the program,
# writes the whole weight in float32 first: 4-15x slower on a CPU (docs/PERF.md, "Block
# products").
MAX_KERNEL_ROWS = 4096
# Values in a scale's block must fill whole vector registers: 16 floats with AVX-512.
_LANES = 16


def block_products_cpu_takes(
    x: jax.Array,
    quants: jax.Array,
    scales: jax.Array,
    offsets: jax.Array | None,
    block: int,
    bits: int,
    out_dtype,
) -> bool:
    """Whether the kernel takes x [..., in] times these quantized weights into `out_dtype`:
    float32 rows and results, 1 to MAX_KERNEL_ROWS rows, int8 [out, in] or 4-bit uint8
    [out, in // 2] quants, float16 or float32 scales [out, in // block] (offsets only with 4
    bits), `in` a multiple of 32, `block` of 16 (32 for 4 bits), `out` of 4."""
    if x.dtype != jnp.float32 or out_dtype != jnp.float32 or quants.ndim != 2:
        return False
    rows = 1
    for size in x.shape[:-1]:
        rows *= size
    width, outs = x.shape[-1], quants.shape[0]
    packed = {8: (jnp.int8, width), 4: (jnp.uint8, width // 2)}.get(bits)
    return (
        packed is not None
        and 0 < rows <= MAX_KERNEL_ROWS
        and (quants.dtype, quants.shape[1]) == packed
        and width % 32 == 0
        and block > 0
        and width % block == 0
        and block % (32 if bits == 4 else _LANES) == 0
        and outs % 4 == 0
        and scales.dtype in (jnp.float16, jnp.float32)
        and scales.shape == (outs, width // block)
        and (
            offsets is None
            or (bits == 4 and offsets.dtype == scales.dtype and offsets.shape == scales.shape)
        )
    )


def block_products_cpu(
    x: jax.Array,
    quants: jax.Array,
    scales: jax.Array,
    offsets: jax.Array | None,
    block: int,
    bits: int,
) -> jax.Array:
    """x [..., in] float32 times the quantized weight [out, in] -> [..., out] float32 on the
    CPU kernel, for the shapes `block_products_cpu_takes` accepts (`block` and `bits` are
    implied by the arrays' shapes and types, and taken for the package's one signature)."""
    del block, bits
    return _product(BLOCK_PRODUCTS, x, quants, scales, offsets)


def _product(target, x, quants, scales, offsets) -> jax.Array:
    # x [..., in] times the weight on `target`'s kernel, whose arguments both kernels share.
    if not cpu_kernels_available():
        raise RuntimeError("the CPU kernels are not built (see the log's warning)")
    rows = x.reshape(-1, x.shape[-1])
    # jax.ffi directly, not call_cpu_kernel, which would widen the 8-bit quants to int32.
    out = jax.ffi.ffi_call(
        target.name,
        jax.ShapeDtypeStruct((rows.shape[0], quants.shape[0]), jnp.float32),
    )(
        rows,
        quants,
        scales,
        jnp.zeros((0,), scales.dtype) if offsets is None else offsets,
    )
    return out.reshape(*x.shape[:-1], quants.shape[0])


def int8_rows_cpu_takes(
    x: jax.Array,
    quants: jax.Array,
    scales: jax.Array,
    offsets: jax.Array | None,
    block: int,
    bits: int,
    out_dtype,
) -> bool:
    """Whether the int8-rows kernel (cpp_kernels/int8_rows.cc) takes x [..., in] times these
    weights: what `block_products_cpu_takes` accepts, with blocks of 32 and `out` a multiple
    of 16."""
    return (
        block == 32
        and quants.ndim == 2
        and quants.shape[0] % 16 == 0
        and block_products_cpu_takes(x, quants, scales, offsets, block, bits, out_dtype)
    )


def int8_rows_cpu(
    x: jax.Array,
    quants: jax.Array,
    scales: jax.Array,
    offsets: jax.Array | None,
    block: int,
    bits: int,
) -> jax.Array:
    """x [..., in] float32, rounded to int8 per block of 32, times the quantized weight
    [out, in] -> [..., out] float32 on the CPU kernel, for the shapes `int8_rows_cpu_takes`
    accepts."""
    del block, bits
    return _product(INT8_ROWS, x, quants, scales, offsets)
