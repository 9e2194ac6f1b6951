"""Where a projection's matrix product runs, and where the routed experts' grouped product
runs: XLA's, or on a CPU the C++ kernels (pallas_kernels/row_products and grouped_products,
whose docstrings say what each costs and why).

A decode step multiplies its 1-32 rows by every weight of the model, which XLA:CPU packs into
its own layout first for more than one row; the row-products kernel reads each weight once
for all the rows. Prompt chunks (hundreds of rows) are compute-bound and stay with XLA. The
routed experts' grouped product runs densely on XLA:CPU (every row against every expert); the
grouped-products kernel runs each row against its own expert, any number of rows.

The choice is made while a step is traced: the engine's step programs enter
`row_products(...)` when their attention backend is "cpu" (one CPU device, kernels built;
etjax/attention/backend.py), so a mesh, where XLA partitions the products, never sees the
kernels. Everything else (`linear`, the LM head) asks `project`, and the routed experts
(etjax/model/experts.py) `grouped_product`; both fall back to XLA for shapes and dtypes the
kernels do not take.

A quantized weight (etjax/model/quantized.py `QuantizedWeight`) goes the same way to the
block-products kernels (pallas_kernels/block_products): the C++ kernel under the same switch
where it takes the shape, else XLA's product of the weight dequantized in the program. An
interleaved one (weights="stored-int8-rows") is multiplied by rows rounded to int8 per block
of 32, on the int8-rows kernel under the switch, else by the same arithmetic in XLA. Experts
kept in blocks (a stacked `QuantizedWeight`) go to the grouped-products kernel, which reads
their blocks, or to XLA's ragged dot of them dequantized (pallas_kernels/grouped_products).
"""

from __future__ import annotations

import contextlib
import contextvars

import jax

from etjax.model.quantized import QuantizedWeight
from pallas_kernels.block_products.xla import block_products_xla, deinterleave_xla, int8_rows_xla
from pallas_kernels.grouped_products import grouped_blocks_xla, grouped_products_xla
from pallas_kernels.row_products import row_products_xla

_ENABLED = contextvars.ContextVar("etjax_row_products", default=False)


@contextlib.contextmanager
def row_products(enabled: bool):
    """While tracing: projections of at most `MAX_KERNEL_ROWS` rows
    (pallas_kernels/row_products/cpu.py), and the experts' grouped products, run the CPU
    kernels."""
    token = _ENABLED.set(enabled)
    try:
        yield
    finally:
        _ENABLED.reset(token)


def project(x: jax.Array, w: jax.Array | QuantizedWeight, out_dtype=None) -> jax.Array:
    """x [..., in] times w [out, in] (output-major, as the model stores it; float or a
    `QuantizedWeight`) -> [..., out], in `out_dtype` (default: x's)."""
    out_dtype = out_dtype or x.dtype
    if isinstance(w, QuantizedWeight):
        return _quantized_product(x, w, out_dtype)
    if _ENABLED.get():
        from pallas_kernels.row_products.cpu import row_products_cpu, row_products_cpu_takes

        if row_products_cpu_takes(x, w, out_dtype):
            return row_products_cpu(x, w)
    return row_products_xla(x, w, out_dtype)


def _quantized_product(x: jax.Array, w: QuantizedWeight, out_dtype) -> jax.Array:
    arrays = (w.quants, w.scales, w.offsets, w.block, w.format.bits)
    if w.format.interleaved:
        return _int8_rows_product(x, w, out_dtype)
    if _ENABLED.get():
        from pallas_kernels.block_products.cpu import (
            block_products_cpu,
            block_products_cpu_takes,
        )

        if block_products_cpu_takes(x, *arrays, out_dtype):
            return block_products_cpu(x, *arrays)
    return block_products_xla(x, *arrays, out_dtype)


def _int8_rows_product(x: jax.Array, w: QuantizedWeight, out_dtype) -> jax.Array:
    # An interleaved weight is multiplied by rows rounded to int8 wherever it runs: on the
    # int8-rows kernel, else the same arithmetic in XLA on the weight deinterleaved.
    arrays = (w.quants, w.scales, w.offsets, w.block, w.format.bits)
    if _ENABLED.get():
        from pallas_kernels.block_products.cpu import int8_rows_cpu, int8_rows_cpu_takes

        if int8_rows_cpu_takes(x, *arrays, out_dtype):
            return int8_rows_cpu(x, *arrays)
    plain = deinterleave_xla(w.quants, w.scales, w.offsets, w.format.bits)
    return int8_rows_xla(x, *plain, w.format.bits, out_dtype)


def grouped_product(
    rows: jax.Array, w: jax.Array | QuantizedWeight, group_sizes: jax.Array
) -> jax.Array:
    """Each row times its own group's matrix: rows [R, K] sorted by group, w [E, N, K]
    (output-major; float or a stacked `QuantizedWeight`), group_sizes [E] int32 (group e takes
    the next group_sizes[e] rows; rows past their sum belong to no group and come out zero)
    -> [R, N] in rows' dtype."""
    if isinstance(w, QuantizedWeight):
        return _quantized_groups(rows, w, group_sizes)
    if _ENABLED.get():
        from pallas_kernels.grouped_products.cpu import (
            grouped_products_cpu,
            grouped_products_cpu_takes,
        )

        if grouped_products_cpu_takes(rows, w, group_sizes):
            return grouped_products_cpu(rows, w, group_sizes)
    return grouped_products_xla(rows, w, group_sizes)


def _quantized_groups(rows: jax.Array, w: QuantizedWeight, group_sizes: jax.Array) -> jax.Array:
    arrays = (w.quants, w.scales, w.offsets, w.block, w.format.bits)
    if _ENABLED.get():
        from pallas_kernels.grouped_products.cpu import (
            grouped_blocks_cpu,
            grouped_blocks_cpu_takes,
        )

        if grouped_blocks_cpu_takes(rows, *arrays, group_sizes):
            return grouped_blocks_cpu(rows, *arrays, group_sizes)
    return grouped_blocks_xla(rows, *arrays, group_sizes)
