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
