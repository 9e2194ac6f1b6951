"""Grouped products in XLA: `jax.lax.ragged_dot_general` (the package docstring)."""

from __future__ import annotations

import jax

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
