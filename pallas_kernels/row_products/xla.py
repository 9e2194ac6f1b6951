"""Row products in XLA: its own product, for every shape (the package docstring)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def row_products_xla(x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
    """x [..., in] times w [out, in] -> [..., out] in `out_dtype` (default: x's)."""
    return jnp.einsum("...i,oi->...o", x, w, preferred_element_type=out_dtype or x.dtype)
