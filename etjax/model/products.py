"""Where a projection's matrix product runs: XLA's, or on a CPU for a few rows the C++ kernel
that reads each weight once for all of them (cpp_kernels/row_products.cc); and where
the routed experts' grouped product runs: XLA's ragged dot, or on a CPU the C++ kernel that
multiplies each row by its own expert only (cpp_kernels/grouped_products.cc).

A decode step multiplies its 1-32 rows by every weight of the model, so on a CPU the step is
the weights' read. XLA:CPU streams them at the machine's bandwidth for one row and packs
them into its own layout first for more (docs/PERF.md, "Row products"): a batch-8 step's
products cost about twice a batch-1 step's. The kernel's cost stays the read up to a few
dozen rows. Prompt chunks (hundreds of rows) are compute-bound and stay with XLA.

The choice is made while a step is traced: the engine's step programs enter
`row_products(...)` when their attention backend is "cpu" (one CPU device, kernels built;
etjax/attention/backend.py), so a mesh, where XLA partitions the products, never sees the
kernel. Everything else (`linear`, the LM head) asks `project`, which falls back to XLA's
product for shapes and dtypes the kernel does not take.

The routed experts (etjax/model/experts.py) ask `grouped_product` under the same context.
XLA:CPU in JAX 0.10.2 runs `jax.lax.ragged_dot_general` densely (every row against every
expert, masked), E times the FLOPs of a token's k experts and a read of every expert's
weights; the kernel reads only the experts that have rows and runs each row against its own.
It takes any number of rows: a prompt chunk's rows are still k per token, not E.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp

# The most rows the kernel takes: at 32 rows its product of SmolLM2's weights matched
# XLA's, and above it XLA's blocked product wins (docs/PERF.md, "Row products").
MAX_KERNEL_ROWS = 32

_ENABLED = contextvars.ContextVar("etjax_row_products", default=False)

# Rows [R, K] against groups [E, N, K] (output-major, as every etjax projection is): the rows
# are ragged along R, group e taking the next `group_sizes[e]` rows.
_GROUPED = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0],
)


@contextlib.contextmanager
def row_products(enabled: bool):
    """While tracing: projections of at most `MAX_KERNEL_ROWS` rows, and the experts' grouped
    products, run the CPU kernels."""
    token = _ENABLED.set(enabled)
    try:
        yield
    finally:
        _ENABLED.reset(token)


def project(x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
    """x [..., in] times w [out, in] (output-major, as the model stores it) -> [..., out], in
    `out_dtype` (default: x's)."""
    out_dtype = out_dtype or x.dtype
    if _takes(x, w, out_dtype):
        from cpp_kernels import call_cpu_kernel
        from cpp_kernels.targets import ROW_PRODUCTS

        rows = x.reshape(-1, x.shape[-1])
        out = call_cpu_kernel(
            ROW_PRODUCTS,
            jax.ShapeDtypeStruct((rows.shape[0], w.shape[0]), jnp.float32),
            rows,
            w,
        )
        return out.reshape(*x.shape[:-1], w.shape[0])
    return jnp.einsum("...i,oi->...o", x, w, preferred_element_type=out_dtype)


def _takes(x: jax.Array, w: jax.Array, out_dtype) -> bool:
    # The kernel's shapes: float32 rows and results, weights of 16 or 32 bits, K a multiple
    # of 16 and N of 4 (row_products.cc).
    if not _ENABLED.get() or x.dtype != jnp.float32 or out_dtype != jnp.float32:
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


def grouped_product(rows: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """Each row times its own group's matrix: rows [R, K] sorted by group, w [E, N, K]
    (output-major), group_sizes [E] int32 (group e takes the next group_sizes[e] rows; rows
    past their sum belong to no group and come out zero) -> [R, N] in rows' dtype."""
    if _takes_grouped(rows, w, group_sizes):
        from cpp_kernels import call_cpu_kernel
        from cpp_kernels.targets import GROUPED_PRODUCTS

        # 16-bit rows (a bfloat16 model) are widened for the kernel and its float32 sums
        # rounded back, as XLA's product with a 16-bit result rounds its own: [R, K] and
        # [R, N] are small beside the experts' weights.
        out = call_cpu_kernel(
            GROUPED_PRODUCTS,
            jax.ShapeDtypeStruct((rows.shape[0], w.shape[1]), jnp.float32),
            rows.astype(jnp.float32),
            w,
            group_sizes,
        )
        return out.astype(rows.dtype)
    return jax.lax.ragged_dot_general(
        rows, w, group_sizes, _GROUPED, preferred_element_type=rows.dtype
    )


def _takes_grouped(rows: jax.Array, w: jax.Array, group_sizes: jax.Array) -> bool:
    # The kernel's shapes: rows and weights of 16 or 32 bits, K a multiple of 16 and N of 4
    # (grouped_products.cc).
    floats = (jnp.float32, jnp.float16, jnp.bfloat16)
    return (
        _ENABLED.get()
        and rows.ndim == 2
        and rows.shape[0] > 0
        and rows.dtype in floats
        and w.ndim == 3
        and w.dtype in floats
        and group_sizes.shape == (w.shape[0],)
        and rows.shape[1] == w.shape[2]
        and rows.shape[1] % 16 == 0
        and w.shape[1] % 4 == 0
    )
