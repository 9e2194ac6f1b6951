"""Block products in XLA: the weight dequantized in the program, then XLA's product. Every
shape and platform (TPU, GPU, a mesh, and the CPU where the kernel does not take the shape)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.block_products.formats import deinterleaved


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


def deinterleave_xla(
    quants: jax.Array, scales: jax.Array, offsets: jax.Array | None, bits: int
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """The arrays of an interleaved weight (formats.py, "Interleaved") in the layout of the
    format it reorders, in the program."""
    return deinterleaved(quants, scales, offsets, bits)


def quantize_rows_xla(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Rows x [M, in] float32 rounded to int8 per block of 32 as cpp_kernels/int8_rows.cc
    rounds them -> (q [M, in / 32, 32] float32 holding the integers, dx [M, in / 32], and
    dx x the sum of each block's q [M, in / 32])."""
    blocks = x.reshape(x.shape[0], x.shape[1] // 32, 32)
    amax = jnp.abs(blocks).max(axis=-1, keepdims=True)
    inverse = jnp.where(amax > 0, 127.0 / jnp.where(amax > 0, amax, 1.0), 0.0)
    q = jnp.clip(jnp.round(blocks * inverse), -127, 127)  # jnp.round: half to even
    dx = amax[..., 0] / 127.0
    return q, dx, dx * q.sum(axis=-1)


def int8_rows_xla(
    x: jax.Array,
    quants: jax.Array,
    scales: jax.Array,
    offsets: jax.Array | None,
    bits: int,
    out_dtype=None,
) -> jax.Array:
    """x [..., in] rounded to int8 per block of 32 times the weight [out, in] in blocks of 32
    (not interleaved) -> [..., out] in `out_dtype`: the int8-rows kernel's arithmetic in XLA,
    for what the kernel does not take, up to float32 rounding. As two products: the rounded
    rows (q x dx) by the weights without their offsets (scale x q, exact in float32), and each
    block's dx x sum(q) by the offsets, so nothing larger than the weight is materialised."""
    out_dtype = out_dtype or x.dtype
    rows = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    q, dx, xsum = quantize_rows_xla(rows)
    rounded = (q * dx[..., None]).reshape(rows.shape)
    outs = quants.shape[0]
    if bits == 4:
        pairs = quants.reshape(outs, -1, 16)
        w = jnp.concatenate([pairs & 0x0F, pairs >> 4], axis=-1).astype(jnp.float32)
        w = w - (8.0 if offsets is None else 0.0)
    else:
        w = quants.reshape(outs, -1, 32).astype(jnp.float32)
    w = (w * scales.astype(jnp.float32)[..., None]).reshape(outs, -1)
    y = jnp.einsum("ri,oi->ro", rounded, w, preferred_element_type=jnp.float32)
    if offsets is not None:
        y = y + xsum @ offsets.astype(jnp.float32).T
    return y.reshape(*x.shape[:-1], outs).astype(out_dtype)
