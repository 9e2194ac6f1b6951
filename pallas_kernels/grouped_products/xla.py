"""Grouped products in XLA: `jax.lax.ragged_dot_general` (the package docstring); experts kept
in blocks dequantized in the program first, as pallas_kernels/block_products/xla.py does for a
projection, or for int8 per channel multiplied as they are and their outputs scaled."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.block_products.xla import dequantize_xla

# Rows [R, K] against groups [E, N, K]: the rows are ragged along R, group e taking the next
# `group_sizes[e]` rows.
_GROUPED = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0],
)


def grouped_products_xla(rows: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """rows [R, K] sorted by group, w [E, N, K], group_sizes [E] int32 -> [R, N] in rows'
    dtype."""
    return jax.lax.ragged_dot_general(
        rows, w, group_sizes, _GROUPED, preferred_element_type=rows.dtype
    )


def row_groups(group_sizes: jax.Array, rows: int) -> jax.Array:
    """The group of each of `rows` rows, [rows] int32: e for group e's rows, E (no group) for
    rows past the sizes' sum."""
    ends = jnp.cumsum(jnp.maximum(group_sizes, 0))
    return jnp.searchsorted(ends, jnp.arange(rows), side="right").astype(jnp.int32)


def grouped_blocks_xla(
    rows: jax.Array,
    quants: jax.Array,
    scales: jax.Array,
    offsets: jax.Array | None,
    block: int,
    bits: int,
    group_sizes: jax.Array,
) -> jax.Array:
    """rows [R, K] sorted by group times each group's weight kept in blocks (quants
    [E, N, ...], scales [E, N, K // block], offsets like scales or None; formats.py) ->
    [R, N] in rows' dtype; any shape, any platform. `block` and `bits` are static."""
    experts, outs = quants.shape[:2]
    width = rows.shape[-1]
    if bits == 8 and offsets is None and block == width:
        # One scale per output channel of each expert: x @ (q s)^T = (x @ q^T) s, so the int8
        # values go into the ragged dot as they are (widened to rows' type, exact: |q| <= 127)
        # and each row's outputs are scaled by its own expert's scales (rows in no group
        # are zero whatever scale they take).
        q = quants.astype(rows.dtype)
        y = jax.lax.ragged_dot_general(
            rows, q, group_sizes, _GROUPED, preferred_element_type=jnp.float32
        )
        group = jnp.minimum(row_groups(group_sizes, rows.shape[0]), experts - 1)
        return (y * scales[:, :, 0].astype(jnp.float32)[group]).astype(rows.dtype)
    flat = lambda a: None if a is None else a.reshape(experts * outs, -1)  # noqa: E731
    w = dequantize_xla(flat(quants), flat(scales), flat(offsets), block, bits, rows.dtype)
    return grouped_products_xla(rows, w.reshape(experts, outs, width), group_sizes)
