"""Block formats of quantized weights, and the GGUF tensors they are read from.

A quantized weight [out, in] (output-major, as etjax keeps every projection) is three arrays:

    quants   int8 [out, in] (8 bits, signed), or uint8 [out, in // 2] (4 bits, 0..15): in
             every 32 values of a row, byte j holds value j in its low nibble and value j + 16
             in its high nibble (GGUF's order, so Q4_0 and Q4_1 load as a copy)
    scales   [out, in // block] float16 or float32: one per `block` values of a row
    offsets  the same shape and dtype as scales, or None

    value = scale * q + offset          4 bits with offsets (Q4_1, Q4_K)
    value = scale * (q - 8)             4 bits without offsets (Q4_0)
    value = scale * q                   8 bits (Q8_0, Q6_K, int8 per output channel)

The K-quants convert into these without loss (the converters here; tests/test_block_products.py
checks them bit for bit against the gguf package): a Q4_K super-block of 256 is eight 4-bit
blocks of 32 with float32 scales d * sc and offsets -(dmin * m), each product of a float16 and
a 6-bit integer exact in float32 (17 significant bits); a Q6_K super-block is sixteen 8-bit
blocks of 16 (q in -32..31) with float32 scales d * sc (float16 times int8: 19 bits, exact).
Only Q4_K's nibbles are reordered (its own order pairs value j with j + 32 of a 64).
Q5_0 reads into Q8_0's layout: its 5-bit values q - 16 as int8 beside the same float16
scale, exact (8 bits a value where the file has 5.5).

Interleaved (`BlockFormat.interleaved`, the formats named "...x16"): the same values and
arrays of the same shapes, reordered within each 16 consecutive output rows for products of
rows rounded to int8 (cpp_kernels/int8_rows.cc), which read 16 outputs' values in the lanes of
one register. The 16 rows' bytes, contiguous in a row-major array, hold their blocks one after
another; block b is chunks of 4 values, chunk c holding each of the 16 rows' bytes 4c..4c+3 of
that block (row after row: 64 bytes); 4 bits: the GGUF byte order above, so chunk c's low
nibbles are values 4c..4c+3 and its high ones 16 + 4c..; 8 bits: values 4c..4c+3. The 16
rows' scales (and offsets) hold block after block, the 16 rows' scales of a block together.
`interleave` and `deinterleave` convert, exactly; blocks of 32 only.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np


@dataclasses.dataclass(frozen=True)
class BlockFormat:
    """How a weight's values are stored: `bits` (8 or 4) a value, one scale (and offset, when
    `offsets`) per `block` values of a row (None: one per output row, the whole row), scales
    and offsets in `scale_dtype` ("float16" or "float32")."""

    name: str
    bits: int
    block: int | None
    offsets: bool
    scale_dtype: str
    interleaved: bool = False

    def block_size(self, in_features: int) -> int:
        """Values per scale for a weight of `in_features` columns."""
        return in_features if self.block is None else self.block


Q8_0 = BlockFormat("q8_0", 8, 32, False, "float16")
Q4_0 = BlockFormat("q4_0", 4, 32, False, "float16")
Q4_1 = BlockFormat("q4_1", 4, 32, True, "float16")
Q4_K = BlockFormat("q4_k", 4, 32, True, "float32")  # converted from GGUF's Q4_K, losslessly
Q6_K = BlockFormat("q6_k", 8, 16, False, "float32")  # converted from GGUF's Q6_K, losslessly
INT8 = BlockFormat("int8", 8, None, False, "float32")  # symmetric, per output channel

# The formats interleaved for int8 rows (module docstring), by the format they reorder.
ROWS = 16  # output rows interleaved together: a register's 32-bit lanes
INTERLEAVED = {
    f.name: dataclasses.replace(f, name=f"{f.name}x16", interleaved=True)
    for f in (Q8_0, Q4_0, Q4_1, Q4_K)
}
# The format an interleaved one reorders, by the interleaved one's name.
PLAIN = {INTERLEAVED[f.name].name: f for f in (Q8_0, Q4_0, Q4_1, Q4_K)}

# GGUF tensor types (gguf.GGMLQuantizationType names) read into a block format.
GGUF_FORMATS = {"Q8_0": Q8_0, "Q4_0": Q4_0, "Q4_1": Q4_1, "Q4_K": Q4_K, "Q6_K": Q6_K,
                "Q5_0": Q8_0}  # fmt: skip
# Bytes of one GGUF block, and the values it holds.
_GGUF_BLOCKS = {"Q8_0": (34, 32), "Q4_0": (18, 32), "Q4_1": (20, 32), "Q4_K": (144, 256),
                "Q6_K": (210, 256), "Q5_0": (22, 32)}  # fmt: skip


class BlockArrays(NamedTuple):
    """A quantized weight's arrays (the module docstring): quants, scales, offsets or None."""

    quants: np.ndarray
    scales: np.ndarray
    offsets: np.ndarray | None


def from_gguf(data: np.ndarray, type_name: str, shape: tuple[int, int]) -> BlockArrays:
    """The arrays of a GGUF tensor of type `type_name` (a key of GGUF_FORMATS) whose raw bytes
    are `data` (uint8, any shape holding the tensor's bytes in order) and whose shape is
    `shape` = (out, in), etjax's order (GGUF lists it reversed). Raises ValueError naming the
    type, the shape or the byte count when they do not fit."""
    if type_name not in GGUF_FORMATS:
        raise ValueError(
            f"GGUF type {type_name!r} has no block format; readable: {', '.join(GGUF_FORMATS)}"
        )
    out, width = shape
    block_bytes, values = _GGUF_BLOCKS[type_name]
    if width % values:
        raise ValueError(f"{type_name} rows of {width} values are not whole blocks of {values}")
    raw = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1)
    expected = out * (width // values) * block_bytes
    if raw.size != expected:
        raise ValueError(
            f"{type_name} tensor of shape {shape} needs {expected} bytes, got {raw.size}"
        )
    blocks = raw.reshape(out, width // values, block_bytes)
    return _CONVERTERS[type_name](blocks)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    # The float16 at byte `start` of every block: [out, blocks].
    return np.ascontiguousarray(blocks[..., start : start + 2]).view(np.float16)[..., 0]


def _rows(values: np.ndarray) -> np.ndarray:
    # [out, blocks, per block] -> [out, blocks * per block]
    return np.ascontiguousarray(values.reshape(values.shape[0], -1))


def _q8_0(blocks: np.ndarray) -> BlockArrays:
    return BlockArrays(_rows(blocks[..., 2:].view(np.int8)), _f16(blocks, 0), None)


def _q4_0(blocks: np.ndarray) -> BlockArrays:
    return BlockArrays(_rows(blocks[..., 2:]), _f16(blocks, 0), None)


def _q4_1(blocks: np.ndarray) -> BlockArrays:
    return BlockArrays(_rows(blocks[..., 4:]), _f16(blocks, 0), _f16(blocks, 2))


def _q4_k(blocks: np.ndarray) -> BlockArrays:
    # Super-block: d f16, dmin f16, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles in
    # which 32-byte chunk c holds sub-block 2c in its low nibbles and 2c + 1 in its high ones.
    d = _f16(blocks, 0).astype(np.float32)[..., None]
    dmin = _f16(blocks, 2).astype(np.float32)[..., None]
    packed = blocks[..., 4:16]
    low, high, extra = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([low & 0x3F, (extra & 0x0F) | ((low >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([high & 0x3F, (extra >> 4) | ((high >> 2) & 0x30)], axis=-1)
    chunks = blocks[..., 16:].reshape(*blocks.shape[:2], 4, 32)
    nibbles = np.stack([chunks & 0x0F, chunks >> 4], axis=3)  # [out, sb, 4, 2, 32]
    values = nibbles.reshape(*blocks.shape[:2], 8, 32)  # sub-block, value
    quants = values[..., :16] | (values[..., 16:] << 4)  # GGUF's 32-block order
    return BlockArrays(_rows(quants), _rows(d * sc), _rows(-(dmin * mins)))


def _q6_k(blocks: np.ndarray) -> BlockArrays:
    # Super-block: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, d f16.
    shape = blocks.shape[:2]
    ql = blocks[..., :128].reshape(*shape, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)
    ql = (ql & 0x0F).reshape(*shape, 8, 32)  # chunk 4 * half + 2 * nibble + value // 32
    shifts = np.array([0, 2, 4, 6], np.uint8)[:, None]
    qh = blocks[..., 128:192].reshape(*shape, 2, 1, 32) >> shifts
    qh = (qh & 0x03).reshape(*shape, 8, 32)  # chunk 4 * half + pair
    q = (ql | (qh << 4)).astype(np.int8) - np.int8(32)
    sc = blocks[..., 192:208].view(np.int8).astype(np.float32)
    d = _f16(blocks, 208).astype(np.float32)[..., None]
    return BlockArrays(_rows(q), _rows(d * sc), None)


def _q5_0(blocks: np.ndarray) -> BlockArrays:
    # Block: d f16, 4 bytes whose bit j is value j's fifth bit, 16 bytes of nibbles (byte j:
    # value j low, j + 16 high). Values q - 16 in -16..15: Q8_0's layout, the same scale.
    qh = np.ascontiguousarray(blocks[..., 2:6]).view("<u4")  # [out, blocks, 1]
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    nibbles = blocks[..., 6:22]
    low = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)
    return BlockArrays(
        _rows((low | (high << 4)).astype(np.int8) - np.int8(16)), _f16(blocks, 0), None
    )


_CONVERTERS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k, "Q6_K": _q6_k,
               "Q5_0": _q5_0}  # fmt: skip


def quantize_int8(w: np.ndarray) -> BlockArrays:
    """Symmetric int8 per output row (the INT8 format) of a float weight w [out, in]: scale =
    max |w| / 127 in float32, q = w / scale rounded to nearest; a row of zeros gets scale 0."""
    w = np.asarray(w, np.float32)
    scales = np.abs(w).max(axis=1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(scales > 0, np.rint(w / scales), 0)
    return BlockArrays(np.clip(q, -127, 127).astype(np.int8), scales.astype(np.float32), None)


def interleavable(fmt: BlockFormat, shape: tuple[int, ...]) -> bool:
    """Whether a weight of `fmt` and `shape` ([out, in]) has an interleaved layout: a format of
    INTERLEAVED, `out` a multiple of 16, `in` of 32."""
    return len(shape) == 2 and fmt.name in INTERLEAVED and shape[0] % ROWS == 0


def _tile_bytes(bits: int) -> int:
    return 16 if bits == 4 else 32  # bytes of a row's block of 32 values


def interleave(arrays: BlockArrays, fmt: BlockFormat) -> BlockArrays:
    """The arrays of a weight of `fmt` (not interleaved; `interleavable`) reordered into
    INTERLEAVED[fmt.name]'s layout (module docstring), the same shapes and dtypes."""
    quants = np.asarray(arrays.quants)
    out, row_bytes = quants.shape
    tile = _tile_bytes(fmt.bits)
    blocks = row_bytes // tile
    # [group, row, block, chunk, byte] -> [group, block, chunk, row, byte]
    q = quants.reshape(out // ROWS, ROWS, blocks, tile // 4, 4).transpose(0, 2, 3, 1, 4)
    return BlockArrays(
        np.ascontiguousarray(q).reshape(out, row_bytes),
        _scales_by_block(arrays.scales),
        None if arrays.offsets is None else _scales_by_block(arrays.offsets),
    )


def deinterleave(arrays: BlockArrays, fmt: BlockFormat) -> BlockArrays:
    """`interleave`'s inverse: the arrays of a weight of an interleaved `fmt` in the layout
    of the format it reorders (NumPy)."""
    host = (None if a is None else np.asarray(a) for a in arrays)
    return BlockArrays(*deinterleaved(*host, fmt.bits))


def deinterleaved(quants, scales, offsets, bits: int) -> tuple:
    """`deinterleave` of NumPy or JAX arrays (reshapes and transposes only, so XLA runs it in
    a program: pallas_kernels/block_products/xla.py `deinterleave_xla`)."""
    out, row_bytes = quants.shape
    tile = _tile_bytes(bits)
    # [group, block, chunk, row, byte] -> [group, row, block, chunk, byte]
    q = quants.reshape(out // ROWS, row_bytes // tile, tile // 4, ROWS, 4).transpose(0, 3, 1, 2, 4)

    def by_row(s):  # [group, block, row] -> [group, row, block]
        return s.reshape(out // ROWS, s.shape[1], ROWS).transpose(0, 2, 1).reshape(s.shape)

    return q.reshape(out, row_bytes), by_row(scales), None if offsets is None else by_row(offsets)


def _scales_by_block(scales: np.ndarray) -> np.ndarray:
    out, blocks = scales.shape  # [group, row, block] -> [group, block, row]
    grouped = np.asarray(scales).reshape(out // ROWS, ROWS, blocks).transpose(0, 2, 1)
    return np.ascontiguousarray(grouped).reshape(out, blocks)
