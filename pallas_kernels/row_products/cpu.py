"""Row products on the C++ kernel (cpp_kernels/row_products.cc): groups of 4 weight rows read
once, every block of input rows multiplied against them while they sit in L1."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from cpp_kernels import call_cpu_kernel
from cpp_kernels.targets import ROW_PRODUCTS

# The most rows the kernel is asked to take: at 32 rows its product of SmolLM2's weights
# matched XLA's, and above it XLA's blocked product wins (docs/PERF.md, "Row products").
MAX_KERNEL_ROWS = 32


def row_products_cpu_takes(x: jax.Array, w: jax.Array, out_dtype) -> bool:
    """Whether the kernel takes x [..., in] times w [out, in] into `out_dtype`: float32 rows
    and results, at most MAX_KERNEL_ROWS rows, weights of 16 or 32 bits, `in` a multiple of
    16 and `out` of 4 (row_products.cc)."""
    if x.dtype != jnp.float32 or out_dtype != jnp.float32:
        return False
    rows = 1
    for size in x.shape[:-1]:
        rows *= size
    return (
        0 < rows <= MAX_KERNEL_ROWS
        and w.ndim == 2
        and w.dtype in (jnp.float32, jnp.float16, jnp.bfloat16)
        and x.shape[-1] % 16 == 0
        and w.shape[0] % 4 == 0
    )


def row_products_cpu(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., in] float32 times w [out, in] -> [..., out] float32 on the CPU kernel, for the
    shapes `row_products_cpu_takes` accepts."""
    rows = x.reshape(-1, x.shape[-1])
    out = call_cpu_kernel(
        ROW_PRODUCTS,
        jax.ShapeDtypeStruct((rows.shape[0], w.shape[0]), jnp.float32),
        rows,
        w,
    )
    return out.reshape(*x.shape[:-1], w.shape[0])
