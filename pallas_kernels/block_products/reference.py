"""Block products in NumPy, float64: the truth the kernels are tested against (formats.py
says what the arrays hold)."""

from __future__ import annotations

import numpy as np


def unpack_nibbles(quants: np.ndarray) -> np.ndarray:
    """uint8 [out, in // 2] of 4-bit values in GGUF's order (byte j of each 32 values holds
    value j low, value j + 16 high) -> uint8 [out, in], values 0..15 in order."""
    pairs = np.asarray(quants, np.uint8).reshape(quants.shape[0], -1, 16)
    return np.concatenate([pairs & 0x0F, pairs >> 4], axis=-1).reshape(quants.shape[0], -1)


def dequantize_reference(
    quants: np.ndarray, scales: np.ndarray, offsets: np.ndarray | None, block: int, bits: int
) -> np.ndarray:
    """The weight [out, in] in float64, exactly (every value is a float16 or float32 times a
    small integer plus another: float64 holds it without rounding)."""
    if bits == 4:
        q = unpack_nibbles(quants).astype(np.float64)
        if offsets is None:
            q -= 8
    else:
        q = np.asarray(quants, np.int8).astype(np.float64)
    out, width = q.shape
    value = q.reshape(out, width // block, block) * np.asarray(scales, np.float64)[..., None]
    if offsets is not None:
        value += np.asarray(offsets, np.float64)[..., None]
    return value.reshape(out, width)


def block_products_reference(
    x: np.ndarray,
    quants: np.ndarray,
    scales: np.ndarray,
    offsets: np.ndarray | None,
    block: int,
    bits: int,
) -> np.ndarray:
    """x [..., in] times the dequantized weight [out, in] -> [..., out], float64."""
    w = dequantize_reference(quants, scales, offsets, block, bits)
    return np.asarray(x, np.float64) @ w.T


def quantize_rows_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows x [M, in] (float32) rounded to int8 per block of 32, as cpp_kernels/int8_rows.cc
    does in float32: dx = max |x| / 127, q = round-half-even(x * (127 / max |x|)) -> (q [M, in]
    int64, dx [M, in // 32] float64, xsum [M, in // 32] float64: dx x the sum of q)."""
    blocks = np.asarray(x, np.float32).reshape(x.shape[0], -1, 32)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inverse = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(blocks * inverse), -127, 127).astype(np.int64)
    dx = (amax[..., 0] / np.float32(127)).astype(np.float64)
    return q.reshape(x.shape), dx, dx * q.sum(axis=-1)


def signed_values(quants: np.ndarray, offsets: np.ndarray | None, bits: int) -> np.ndarray:
    """The integers a weight's scales multiply, [out, in] int64: q (8 bits, or 4 bits with
    offsets) or q - 8 (4 bits without)."""
    if bits == 8:
        return np.asarray(quants, np.int8).astype(np.int64)
    q = unpack_nibbles(quants).astype(np.int64)
    return q if offsets is not None else q - 8


def int8_rows_reference(
    x: np.ndarray, quants: np.ndarray, scales: np.ndarray, offsets: np.ndarray | None, bits: int
) -> np.ndarray:
    """x [M, in] rounded to int8 per block of 32 (quantize_rows_reference) times the weight
    [out, in] in blocks of 32 -> [M, out] float64: per block, the exact integer dot product
    times scale x dx, plus offset x dx x the sum of the block's quantized values."""
    q, dx, xsum = quantize_rows_reference(x)
    w = signed_values(quants, offsets, bits)
    rows, outs = q.shape[0], w.shape[0]
    dots = np.einsum("rbi,obi->rob", q.reshape(rows, -1, 32), w.reshape(outs, -1, 32))
    out = (dots * np.asarray(scales, np.float64)[None] * dx[:, None, :]).sum(axis=-1)
    if offsets is not None:
        out += xsum @ np.asarray(offsets, np.float64).T
    return out


def int8_rows_bound(
    x: np.ndarray, quants: np.ndarray, scales: np.ndarray, offsets: np.ndarray | None, bits: int
) -> np.ndarray:
    """How far int8 rows may put a product [M, out] from float32 rows' exact one: each value
    is rounded by at most dx / 2 and multiplied by its whole weight, so per block dx / 2 x the
    sum of the weights' magnitudes; plus float32 slack."""
    _, dx, _ = quantize_rows_reference(x)
    w = dequantize_reference(quants, scales, offsets, 32, bits)
    magnitude = np.abs(w).reshape(w.shape[0], -1, 32).sum(-1)  # [out, blocks]
    rounding = dx / 2 @ magnitude.T
    exact = np.abs(block_products_reference(x, quants, scales, offsets, 32, bits))
    return rounding * (1 + 1e-5) + 1e-5 * exact + 1e-30
