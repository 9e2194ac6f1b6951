"""Assemble the `Weights` pytree from a model file's tensors, one tensor and one chunk at a time.

A loader describes each tensor it needs as a `SourceTensor`: its shape in Hugging Face layout and
a way to read its rows as float32. Nothing is read until the leaf that needs it is built, and
each leaf is written chunk by chunk straight into one host buffer already in its final dtype and
layout (q|k|v and gate|up fused, projections input-major), which JAX then adopts as the array's
memory on CPU, or copies to an accelerator and lets go. So at any moment the host holds the
finished leaves plus one chunk of float32: never a float32 copy of the whole model, nor the parts
of a fused matrix beside the matrix. The float32 to bfloat16 cast is the one numpy (ml_dtypes)
does on assignment: round to nearest even, bit for bit what `jnp.astype` gives.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import jax
import numpy as np

from etjax.model.weights import LayerWeights, Weights

# float32 bytes per chunk. A chunk, and the few times its size that dequantizing it takes in
# temporaries, is all a leaf costs beyond its own final bytes; at 16 MiB the embedding's chunks,
# built last, lifted a bfloat16 SmolLM2's peak by 0.15x of its weights.
CHUNK_BYTES = 4 << 20
# XLA's CPU client adopts a host buffer aligned to 64 bytes as the device array's own memory;
# numpy puts large arrays 16 bytes past a page boundary, which it copies instead, so the leaf
# would exist twice until the copy completes.
_ALIGNMENT = 64


@dataclass(frozen=True)
class SourceTensor:
    """A tensor of a model file, read on demand.

    `shape` is Hugging Face's: `[out, in]` for a projection, `[V, D]` for the embedding, `[D]`
    for a norm or bias. `read_rows(rows_per_chunk)` yields the tensor's rows in order as float32
    arrays of at most `rows_per_chunk` rows (a small 1-D tensor may come whole).
    """

    shape: tuple[int, ...]
    read_rows: Callable[[int], Iterator[np.ndarray]]


def assembled_layer(
    *,
    attn_norm: SourceTensor,
    wq: SourceTensor,
    wk: SourceTensor,
    wv: SourceTensor,
    wo: SourceTensor,
    mlp_norm: SourceTensor,
    w_gate: SourceTensor,
    w_up: SourceTensor,
    w_down: SourceTensor,
    dtype: np.dtype,
    bq: SourceTensor | None = None,
    bk: SourceTensor | None = None,
    bv: SourceTensor | None = None,
) -> LayerWeights:
    """One layer's `LayerWeights` from Hugging Face-layout tensors; matrices in `dtype`.

    Norm scales stay float32: they are tiny and RMSNorm runs in float32 anyway.
    """
    return LayerWeights(
        attn_norm=as_stored(attn_norm, np.float32),
        wqkv=input_major([wq, wk, wv], dtype),
        bqkv=None if bq is None else input_major([bq, bk, bv], dtype),
        wo=input_major([wo], dtype),
        mlp_norm=as_stored(mlp_norm, np.float32),
        w_gate_up=input_major([w_gate, w_up], dtype),
        w_down=input_major([w_down], dtype),
    )


def assembled_weights(
    *,
    embed: SourceTensor,
    layers: Sequence[LayerWeights],
    final_norm: SourceTensor,
    lm_head: SourceTensor | None,
    dtype: np.dtype,
) -> Weights:
    """The `Weights` pytree from built layers and the remaining tensors; matrices in `dtype`.

    `lm_head` is Hugging Face-layout `[V, D]`, stored input-major `[D, V]`.
    """
    return Weights(
        embed=as_stored(embed, dtype),
        layers=tuple(layers),
        final_norm=as_stored(final_norm, np.float32),
        lm_head=None if lm_head is None else input_major([lm_head], dtype),
    )


def as_stored(tensor: SourceTensor, dtype: np.dtype) -> jax.Array:
    """`tensor` in its own layout, cast to `dtype`."""
    out = _empty_aligned(tensor.shape, dtype)
    row = 0
    for rows in tensor.read_rows(_rows_per_chunk(tensor)):
        out[row : row + len(rows)] = rows
        row += len(rows)
    _check_rows_read(row, tensor)
    return jax.device_put(out)


def input_major(parts: Sequence[SourceTensor], dtype: np.dtype) -> jax.Array:
    """`parts` concatenated along their first axis and transposed, cast to `dtype`.

    `[out_i, in]` parts give `[in, sum(out_i)]`; 1-D parts (biases) give `[sum(out_i)]`.
    """
    inner = parts[0].shape[1:]
    out = _empty_aligned((*inner, sum(p.shape[0] for p in parts)), dtype)
    column = 0
    for part in parts:
        first = column
        for rows in part.read_rows(_rows_per_chunk(part)):
            out[..., column : column + len(rows)] = rows.T
            column += len(rows)
        _check_rows_read(column - first, part)
    return jax.device_put(out)


def _rows_per_chunk(tensor: SourceTensor) -> int:
    row_bytes = 4 * math.prod(tensor.shape[1:])
    return max(1, CHUNK_BYTES // row_bytes)


def _check_rows_read(count: int, tensor: SourceTensor) -> None:
    # A short read would leave part of an uninitialised buffer in the model.
    if count != tensor.shape[0]:
        raise ValueError(f"read {count} rows of a tensor of shape {tensor.shape}")


def _empty_aligned(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + _ALIGNMENT, dtype=np.uint8)
    start = -raw.ctypes.data % _ALIGNMENT
    return raw[start : start + nbytes].view(dtype).reshape(shape)
