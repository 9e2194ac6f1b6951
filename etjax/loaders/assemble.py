"""Assemble the `Weights` pytree from a model file's tensors, one tensor and one chunk at a time.

One loop for every format and family: the weight tables (etjax/model/leaves.py) say which
tensors each leaf is built from and how; a loader only finds a tensor by its format's name and
describes it as a `SourceTensor`: its shape in Hugging Face layout and a way to read its rows
as float32. Nothing is read until the leaf that needs it is built, and
each leaf is written chunk by chunk straight into one host buffer already in its final dtype and
layout (q|k|v and gate|up fused, projections `[out, in]`), which JAX then adopts as the array's
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

from etjax.errors import ModelLoadError
from etjax.model.config import ModelConfig
from etjax.model.families import family
from etjax.model.leaves import STORED, Leaf, Part
from etjax.model.weights import Weights, model_leaves

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

    `name` is the file's name for it (for errors). `shape` is Hugging Face's: `[out, in]` for
    a projection, `[V, D]` for the embedding, `[D]` for a norm or bias.
    `read_rows(rows_per_chunk)` yields the tensor's rows in order as float32 arrays of at most
    `rows_per_chunk` rows (a small 1-D tensor may come whole).
    """

    name: str
    shape: tuple[int, ...]
    read_rows: Callable[[int], Iterator[np.ndarray]]


# A loader's access to its file: the tensor of `part` for layer i (None outside the layers),
# or ModelLoadError naming the file and the tensor when the file lacks it.
FindTensor = Callable[[Part, int | None], SourceTensor]


def assemble_weights(cfg: ModelConfig, find: FindTensor, origin: str) -> Weights:
    """The `Weights` of a model with config `cfg`, leaf by leaf as the tables describe them
    (etjax/model/weights.py `MODEL_LEAVES`, the family's layer table), in their final dtypes.

    Layers come first, then the embedding and LM head, whose chunks are the largest. Raises
    ModelLoadError naming `origin`, the leaf and its tensors when the tensors' shapes do not
    give the leaf's shape from the config.
    """
    fam = family(cfg.architecture)

    def build(name: str, leaf: Leaf, layer: int | None) -> jax.Array | None:
        if not leaf.has(cfg, layer):
            return None
        parts = [find(part, layer) for part in leaf.source_parts(cfg)]
        got, want = _built_shape(leaf, parts), leaf.shape(cfg)
        if leaf.per_expert and got is not None and got[0] % cfg.num_experts == 0:
            got = (cfg.num_experts, got[0] // cfg.num_experts, *got[1:])
        if got != want:
            where = name if layer is None else f"layer {layer} {name}"
            tensors = ", ".join(f"{p.name!r} {p.shape}" for p in parts)
            raise ModelLoadError(
                f"{origin}: {where} (from {tensors}) would have shape {got}; the config "
                f"gives {want}"
            )
        dtype = leaf.dtype(cfg)
        if leaf.layout == STORED:
            return as_stored(parts[0], dtype)
        return output_major(parts, dtype, shape=want)

    layers = tuple(
        fam.layer_type(**{name: build(name, leaf, i) for name, leaf in fam.layer.items()})
        for i in range(cfg.num_layers)
    )
    model = {name: build(name, leaf, None) for name, leaf in model_leaves(cfg).items()}
    return Weights(layers=layers, logit_softcap=cfg.final_logit_softcapping, **model)


def _built_shape(leaf: Leaf, parts: Sequence[SourceTensor]) -> tuple[int, ...] | None:
    # The shape `as_stored` or `output_major` would build from `parts`; None where the parts'
    # input dimensions disagree and cannot be concatenated at all.
    if leaf.layout == STORED:
        return parts[0].shape
    inner = parts[0].shape[1:]
    if any(p.shape[1:] != inner for p in parts):
        return None
    return (sum(p.shape[0] for p in parts), *inner)


def as_stored(tensor: SourceTensor, dtype: np.dtype) -> jax.Array:
    """`tensor` in its own layout, cast to `dtype`."""
    out = _empty_aligned(tensor.shape, dtype)
    row = 0
    for rows in tensor.read_rows(_rows_per_chunk(tensor)):
        out[row : row + len(rows)] = rows
        row += len(rows)
    _check_rows_read(row, tensor)
    return jax.device_put(out)


def output_major(
    parts: Sequence[SourceTensor], dtype: np.dtype, shape: tuple[int, ...] | None = None
) -> jax.Array:
    """`parts` concatenated along their first (output) axis, cast to `dtype`.

    `[out_i, in]` parts give `[sum(out_i), in]`; 1-D parts (biases) give `[sum(out_i)]`;
    `shape`: that array's final shape (per-expert leaves: `[E, sum(out_i) / E, in]`).
    """
    inner = parts[0].shape[1:]
    out = _empty_aligned((sum(p.shape[0] for p in parts), *inner), dtype)
    row = 0
    for part in parts:
        first = row
        for rows in part.read_rows(_rows_per_chunk(part)):
            out[row : row + len(rows)] = rows
            row += len(rows)
        _check_rows_read(row - first, part)
    return jax.device_put(out if shape is None else out.reshape(shape))


def _rows_per_chunk(tensor: SourceTensor) -> int:
    row_bytes = 4 * math.prod(tensor.shape[1:])
    return max(1, CHUNK_BYTES // row_bytes)


def _check_rows_read(count: int, tensor: SourceTensor) -> None:
    # A short read would leave part of an uninitialised buffer in the model.
    if count != tensor.shape[0]:
        raise ValueError(f"read {count} rows of tensor {tensor.name!r} of shape {tensor.shape}")


def _empty_aligned(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + _ALIGNMENT, dtype=np.uint8)
    start = -raw.ctypes.data % _ALIGNMENT
    return raw[start : start + nbytes].view(dtype).reshape(shape)
