"""Block products in XLA: the weight dequantized in the program, then XLA's product. Every
shape and platform (TPU, GPU, a mesh, and the CPU where the kernel does not take the shape)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def dequantize_xla(
    quants: jax.Array,
    scales: jax.Array,
    offsets: jax.Array | None,
    block: int,
    bits: int,
    dtype=jnp.float32,
) -> jax.Array:
    """The weight [out, in] in `dtype` (formats.py says what the arrays hold), computed in
    float32 and then rounded to `dtype`."""
    if bits == 4:
        out = quants.shape[0]
        pairs = quants.reshape(out, -1, 16)
        q = jnp.concatenate([pairs & 0x0F, pairs >> 4], axis=-1).reshape(out, -1)
        q = q.astype(jnp.float32) - (8.0 if offsets is None else 0.0)
    else:
        q = quants.astype(jnp.float32)
    out, width = q.shape
    value = q.reshape(out, width // block, block) * scales.astype(jnp.float32)[..., None]
    if offsets is not None:
        value = value + offsets.astype(jnp.float32)[..., None]
    return value.reshape(out, width).astype(dtype)


def block_products_xla(
    x: jax.Array,
    quants: jax.Array,
    scales: jax.Array,
    offsets: jax.Array | None,
    block: int,
    bits: int,
    out_dtype=None,
) -> jax.Array:
    """x [..., in] times the quantized weight [out, in] -> [..., out] in `out_dtype` (default:
    x's). `block` and `bits` are static (Python ints)."""
    out_dtype = out_dtype or x.dtype
    width = x.shape[-1]
    if bits == 8 and offsets is None and block == width:
        # One scale per output: the int8 weights go into the product as they are, widened
        # to x's type inside it (on a TPU, int8 x bfloat16 on the matrix unit), and the
        # output is scaled.
        y = jnp.einsum(
            "...i,oi->...o",
            x,
            quants.astype(x.dtype),
            preferred_element_type=jnp.float32,
        )
        return (y * scales[:, 0].astype(jnp.float32)).astype(out_dtype)
    w = dequantize_xla(quants, scales, offsets, block, bits, x.dtype)
    return jnp.einsum("...i,oi->...o", x, w, preferred_element_type=out_dtype)
