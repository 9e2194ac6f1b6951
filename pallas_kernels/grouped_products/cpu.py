"""Grouped products on the C++ kernel (cpp_kernels/grouped_products.cc): units of (expert
with rows, 32 outputs), so each expert's weights are read once for all its rows and experts
without rows not at all."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from cpp_kernels import call_cpu_kernel
from cpp_kernels.targets import GROUPED_PRODUCTS

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
    out = call_cpu_kernel(
        GROUPED_PRODUCTS,
        jax.ShapeDtypeStruct((rows.shape[0], w.shape[1]), jnp.float32),
        rows.astype(jnp.float32),
        w,
        group_sizes,
    )
    return out.astype(rows.dtype)
