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

The `weights` option (etjax/model/quantized.py) decides how the matrices (projections, the
embedding, the LM head: `Leaf.is_matrix`) are held: "int8" quantizes each one as it is built
(in float32, one leaf at a time), "stored" keeps a GGUF tensor's blocks (`SourceTensor.blocks`)
and refuses by name a block type the kernels cannot read, "float32" or "bfloat16" builds them
in that dtype. "int8" and "stored" hold a mixture's stacked experts so too
(`Leaf.is_quantizable`: each expert's weight quantized on its own, stacked). Every other leaf
is built as it always was.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from etjax.errors import ModelLoadError
from etjax.model.config import ModelConfig
from etjax.model.families import family
from etjax.model.leaves import STORED, Leaf, Part
from etjax.model.quantized import (
    GGUF_BLOCK_TYPES,
    GGUF_FORMATS,
    STORED_CHOICES,
    QuantizedWeight,
    concatenate_rows,
    from_block_arrays,
    int8_weight,
    interleaved_blocks,
    interleaved_weight,
)
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
    `block_type`: the file's name of its quantized type (a GGUF tensor's "Q4_1"), None for a
    float tensor; `blocks()`, where the kernels read that type, gives its block format and
    arrays (pallas_kernels/block_products/formats.py), rows in the order `read_rows` gives.
    """

    name: str
    shape: tuple[int, ...]
    read_rows: Callable[[int], Iterator[np.ndarray]]
    block_type: str | None = None
    blocks: Callable[[], tuple[Any, Any]] | None = None


# A loader's access to its file: the tensor of `part` for layer i (None outside the layers),
# or ModelLoadError naming the file and the tensor when the file lacks it.
FindTensor = Callable[[Part, int | None], SourceTensor]


def assemble_weights(
    cfg: ModelConfig,
    find: FindTensor,
    origin: str,
    weights: str | None = None,
    strict: bool = True,
) -> Weights:
    """The `Weights` of a model with config `cfg`, leaf by leaf as the tables describe them
    (etjax/model/weights.py `MODEL_LEAVES`, the family's layer table), in their final dtypes.

    `weights`: how the matrices are held ("stored", "stored-int8-rows", "int8", "float32",
    "bfloat16"; None: in
    `cfg.dtype`, as every other leaf). Layers come first, then the embedding and LM head,
    whose chunks are the largest. Raises ModelLoadError naming `origin`, the leaf and its
    tensors when the tensors' shapes do not give the leaf's shape from the config, and with
    "stored" a quantized tensor the kernels cannot read or parts of different block types
    (unless not `strict`, weights="auto"'s choice: then that matrix is built in `cfg.dtype`).
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
        if weights is None or not leaf.is_quantizable:
            pass
        elif weights == "int8":
            return int8_weight(_host(leaf, parts, np.float32, want))
        elif weights in STORED_CHOICES:
            where = name if layer is None else f"layer {layer} {name}"
            int8_rows = weights == "stored-int8-rows"
            kept = _stored_blocks(parts, origin, where, want, strict, int8_rows)
            if kept is not None:
                return kept
        elif leaf.is_matrix:  # "float32" or "bfloat16"
            dtype = jax.numpy.dtype(weights)
        return jax.device_put(_host(leaf, parts, dtype, want))

    layers = tuple(
        fam.layer_type(**{name: build(name, leaf, i) for name, leaf in fam.layer.items()})
        for i in range(cfg.num_layers)
    )
    model = {name: build(name, leaf, None) for name, leaf in model_leaves(cfg).items()}
    return Weights(layers=layers, logit_softcap=cfg.final_logit_softcapping, **model)


def reform_weights(weights: Weights, cfg: ModelConfig, storage: str) -> Weights:
    """`weights` with its matrices (`Leaf.is_matrix`) held as `storage` says ("int8",
    "float32", "bfloat16"; "stored": as they are; "stored-int8-rows": blocks of 32 interleaved
    for int8 rows): what a checkpoint saved one way becomes when
    loaded another. int8 is quantized from the float32 values (a quantized matrix's own).
    Stacked experts (`Leaf.is_quantizable`) follow "int8"; with a float `storage` they are
    floats of the model's dtype, as a load with that option builds them."""
    if storage == "stored":
        return weights
    fam = family(cfg.architecture)

    def reform(value, leaf: Leaf):
        if value is None:
            return None
        if storage == "stored-int8-rows":
            return interleaved_weight(value) if isinstance(value, QuantizedWeight) else value
        if storage == "int8":
            if isinstance(value, QuantizedWeight) and value.format.name == "int8":
                return value
            return int8_weight(np.asarray(_as_float(value, jax.numpy.float32)))
        dtype = jax.numpy.dtype(storage) if leaf.is_matrix else leaf.dtype(cfg)
        return _as_float(value, dtype)

    def table(tree, leaves):
        kept = [(name, leaf) for name, leaf in leaves.items() if leaf.is_quantizable]
        return tree.replace(**{name: reform(getattr(tree, name), leaf) for name, leaf in kept})

    layers = tuple(table(layer, fam.layer) for layer in weights.layers)
    return table(weights, model_leaves(cfg)).replace(layers=layers)


def _as_float(value, dtype) -> jax.Array:
    if isinstance(value, QuantizedWeight):
        return value.dequantize(dtype)
    return value.astype(dtype)


def _host(leaf: Leaf, parts: Sequence[SourceTensor], dtype, shape: tuple[int, ...]) -> np.ndarray:
    # The leaf built in host memory, in `dtype`.
    if leaf.layout == STORED:
        return _stored_host(parts[0], dtype)
    return _output_major_host(parts, dtype, shape)


def _stored_blocks(
    parts: Sequence[SourceTensor],
    origin: str,
    where: str,
    shape,
    strict: bool = True,
    int8_rows: bool = False,
):
    # The leaf's blocks as the file holds them (None: float tensors, built as floats); with
    # `int8_rows`, interleaved where the format has that layout. Every part quantized in one
    # type the kernels read, else a ModelLoadError naming it (not `strict`: None, floats).
    quantized = [p for p in parts if p.block_type is not None]
    if not quantized:
        return None
    unreadable = any(p.block_type is None or p.blocks is None for p in parts)
    mixed = len({GGUF_FORMATS.get(p.block_type) for p in parts}) > 1
    if not strict and (unreadable or mixed):
        return None
    for p in parts:
        if p.block_type is None or p.blocks is None:
            kind = "a float tensor" if p.block_type is None else f"type {p.block_type}"
            raise ModelLoadError(
                f"{origin}: tensor {p.name!r} ({where}) has {kind}, which weights='stored' "
                f"cannot keep as blocks; allowed: {', '.join(GGUF_BLOCK_TYPES)} (all parts of a "
                "fused matrix of one type); load it with weights='int8', 'float32' or "
                "'bfloat16' to convert it"
            )
    read = [p.blocks() for p in parts]
    formats = {fmt.name for fmt, _ in read}
    if len(formats) > 1:
        types = ", ".join(f"{p.name!r} {p.block_type}" for p in parts)
        raise ModelLoadError(
            f"{origin}: {where} fuses tensors of different block types ({types}), which "
            "weights='stored' cannot hold as one matrix yet; load it with weights='int8', "
            "'float32' or 'bfloat16'"
        )
    arrays = concatenate_rows([a for _, a in read]) if len(read) > 1 else read[0][1]
    fmt = read[0][0]
    if int8_rows:
        arrays, fmt = interleaved_blocks(arrays, fmt, shape)
    return from_block_arrays(arrays, fmt, shape)


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
    return jax.device_put(_stored_host(tensor, dtype))


def _stored_host(tensor: SourceTensor, dtype: np.dtype) -> np.ndarray:
    out = _empty_aligned(tensor.shape, dtype)
    row = 0
    for rows in tensor.read_rows(_rows_per_chunk(tensor)):
        out[row : row + len(rows)] = rows
        row += len(rows)
    _check_rows_read(row, tensor)
    return out


def output_major(
    parts: Sequence[SourceTensor], dtype: np.dtype, shape: tuple[int, ...] | None = None
) -> jax.Array:
    """`parts` concatenated along their first (output) axis, cast to `dtype`.

    `[out_i, in]` parts give `[sum(out_i), in]`; 1-D parts (biases) give `[sum(out_i)]`;
    `shape`: that array's final shape (per-expert leaves: `[E, sum(out_i) / E, in]`).
    """
    return jax.device_put(_output_major_host(parts, dtype, shape))


def _output_major_host(
    parts: Sequence[SourceTensor], dtype: np.dtype, shape: tuple[int, ...] | None
) -> np.ndarray:
    inner = parts[0].shape[1:]
    out = _empty_aligned((sum(p.shape[0] for p in parts), *inner), dtype)
    row = 0
    for part in parts:
        first = row
        for rows in part.read_rows(_rows_per_chunk(part)):
            out[row : row + len(rows)] = rows
            row += len(rows)
        _check_rows_read(row - first, part)
    return out if shape is None else out.reshape(shape)


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
