"""Quantized weights kept quantized at run time: the `QuantizedWeight` leaf, and the `weights`
option that chooses, at load, how a model's matrices are held.

A `QuantizedWeight` stands where a float matrix [out, in] stands in the `Weights` pytree (a
projection, the embedding, the LM head), or a mixture of experts' stacked experts [E, out, in]
(each expert's weight quantized on its own, the arrays stacked on a leading expert axis): its
arrays (`quants`, `scales`, `offsets`, laid out as
pallas_kernels/block_products/formats.py says) are the pytree's children, so placement,
checkpoints and byte counts see three arrays; its `format` and logical `shape` are static.
A product with it runs the block-products kernels (etjax/model/products.py `project`; the
experts' grouped products `grouped_product`, on the grouped-products kernel); the embedding
gathers the rows of its tokens and dequantizes only those (`embedding_rows`).

`weights`, the load option (`load_model(weights=...)`, `[model] weights`, `--weights`):

    "stored"    a GGUF file's blocks as the file has them (Q8_0, Q4_0, Q4_1; Q4_K and Q6_K
                converted at load without loss, formats.py); a block type the kernels cannot
                read is refused by name. Float tensors (and a Hugging Face folder's) load in the
                model's dtype, as the file holds floats.
    "stored-int8-rows"  the same blocks, multiplied by rows rounded to int8 per block of 32
                (llama.cpp's arithmetic): a matrix in blocks of 32 (Q8_0, Q4_0, Q4_1, Q4_K) is
                reordered at load into its format's interleaved layout (formats.py), which the
                int8-rows kernel (cpp_kernels/int8_rows.cc) reads with AVX-512 VNNI dot
                products; other matrices, and stacked experts, as "stored". Faster than
                "stored" at every step size measured, for the rounding of the rows (at most
                half a step of each block's int8 grid; docs/PERF.md, "Int8 rows").
    "int8"      symmetric int8 per output channel, quantized at load from the float32 values
                of any source (a Hugging Face folder, a float or quantized GGUF, a checkpoint).
    "float32", "bfloat16"   float matrices of that dtype; activations stay in `dtype`.
    "auto"      what `auto_weights` (below) derives from the file and the machine: "stored"
                for a GGUF whose matrices are blocks the kernels read, run in float32 on one CPU
                device; else float matrices in the model's dtype. Where "auto" picked "stored",
                a matrix it cannot keep as blocks loads as floats instead of being refused.

`dtype` stays what it was: the dtype of activations, the KV cache (unless `kv_dtype` says
otherwise), norms' arithmetic and every leaf `weights` does not cover. `weights` says only how
the matrices are stored. "stored" and "int8" cover a mixture of experts' stacked experts too
(int8: per output channel of each expert); with "float32" or "bfloat16" they stay in the
model's dtype. Norms, biases and the routers of a mixture of experts stay float in the model's
dtype whatever `weights` says.
"""

from __future__ import annotations

import math
from collections.abc import Collection

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from etjax.errors import FieldError
from pallas_kernels.block_products.formats import (
    GGUF_FORMATS,
    INT8,
    INTERLEAVED,
    PLAIN,
    Q4_0,
    Q4_1,
    Q4_K,
    Q6_K,
    Q8_0,
    ROWS,
    BlockArrays,
    BlockFormat,
    from_gguf,
    interleavable,
    interleave,
    quantize_int8,
)
from pallas_kernels.block_products.xla import deinterleave_xla, dequantize_xla

WEIGHTS_CHOICES = ("auto", "stored", "stored-int8-rows", "int8", "float32", "bfloat16")
# The choices that keep a GGUF file's own blocks.
STORED_CHOICES = ("stored", "stored-int8-rows")

# The GGUF tensor types weights="stored" keeps as blocks.
GGUF_BLOCK_TYPES = tuple(GGUF_FORMATS)
# Every block format by its name (a checkpoint's manifest records formats by name).
FORMATS = {f.name: f for f in (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K, INT8, *INTERLEAVED.values())}


def check_weights(weights: object, field: str = "weights") -> str:
    """`weights` if it is one of WEIGHTS_CHOICES, else FieldError naming `field`."""
    if weights not in WEIGHTS_CHOICES:
        raise FieldError(field, weights, f"one of {WEIGHTS_CHOICES}")
    return weights


def auto_weights(
    dtype: str,
    block_types: Collection[str] = (),
    platform: str = "cpu",
    devices: int = 1,
    kernels: bool = True,
) -> str:
    """What weights="auto" holds a model's matrices as, for a model of (resolved) `dtype` whose
    source's matrices are quantized in `block_types` (a GGUF's tensor type names, "Q4_1"; none
    for a float file, a Hugging Face folder or a plan), run on `devices` devices of `platform`
    ("cpu", "gpu", "tpu") where the C++ kernels are built or not (`kernels`): "stored" where
    the matrices are blocks the kernels read (GGUF_BLOCK_TYPES), the model runs in float32 on
    one CPU device and the kernels are built, else `dtype` (float matrices).

    Why only there: the block-products C++ kernels are what was measured faster than float32
    end to end (SmolLM2 Q4_1: 2.06x llama.cpp at batch 1 where float32 is 0.94x, docs/PERF.md);
    they take float32 activations on one device (the engine's "cpu" backend). A mesh, a GPU or
    a TPU would run XLA's product of the blocks dequantized in the program (slower than float
    matrices on a CPU, unmeasured elsewhere), and there int8 is the format to ask for."""
    readable = any(t in GGUF_BLOCK_TYPES for t in block_types)
    on_cpu_kernels = platform == "cpu" and devices == 1 and kernels
    return "stored" if readable and on_cpu_kernels and dtype == "float32" else dtype


def resolve_weights(weights: str, dtype: str, **facts) -> str:
    """The storage `weights` means for a model of (resolved) `dtype`: "stored", "int8",
    "float32" or "bfloat16"; "auto" is `auto_weights(dtype, **facts)` (without facts: `dtype`,
    float matrices, as for a source with no blocks)."""
    check_weights(weights)
    if weights != "auto":
        return weights
    return auto_weights(dtype, **facts)


@flax.struct.dataclass
class QuantizedWeight:
    """A matrix [out, in] (`shape`, output-major as every projection) held as blocks of
    `format` (pallas_kernels/block_products/formats.py): quants [out, in] int8 or
    [out, in // 2] uint8 (two 4-bit values a byte), scales [out, in // block] (block: the
    format's, or `in` for one per output channel), offsets like scales or None. Stacked
    experts, `shape` [E, out, in]: every array has the leading expert axis E."""

    quants: jax.Array
    scales: jax.Array
    offsets: jax.Array | None
    format: BlockFormat = flax.struct.field(pytree_node=False)
    shape: tuple[int, ...] = flax.struct.field(pytree_node=False)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def block(self) -> int:
        """Values of a row per scale."""
        return self.format.block_size(self.shape[-1])

    @property
    def nbytes(self) -> int:
        """Bytes the arrays hold (what the weight costs resident)."""
        return sum(_nbytes(a) for a in (self.quants, self.scales, self.offsets) if a is not None)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """The float matrix [out, in] (stacked: [E, out, in]) in `dtype`, computed in float32
        (scale * q + offset)."""
        rows = math.prod(self.shape[:-1])
        flat = lambda a: None if a is None else a.reshape(rows, a.shape[-1])  # noqa: E731
        arrays = (flat(self.quants), flat(self.scales), flat(self.offsets))
        if self.format.interleaved:
            arrays = deinterleave_xla(*arrays, self.format.bits)
        w = dequantize_xla(*arrays, self.block, self.format.bits, dtype)
        return w.reshape(self.shape)

    def take_rows(self, rows: jax.Array) -> QuantizedWeight:
        """The weight of rows `rows` [N] int32 only (their blocks, not dequantized; of stacked
        experts, the experts `rows`). Of an interleaved weight, the rows' 16-row groups are
        gathered and deinterleaved: the result is in the layout of the format it reorders."""
        if self.format.interleaved:
            return self._take_interleaved_rows(rows)
        offsets = None if self.offsets is None else self.offsets[rows]
        return self.replace(
            quants=self.quants[rows],
            scales=self.scales[rows],
            offsets=offsets,
            shape=(rows.shape[0], *self.shape[1:]),
        )

    def _take_interleaved_rows(self, rows: jax.Array) -> QuantizedWeight:
        groups, lane = rows // ROWS, rows % ROWS

        def gathered(a):  # [N, 16 rows of the group, last]
            return a.reshape(-1, ROWS, a.shape[-1])[groups]

        arrays = (gathered(self.quants), gathered(self.scales))
        arrays += (None if self.offsets is None else gathered(self.offsets),)
        count = rows.shape[0]
        flat = lambda a: None if a is None else a.reshape(count * ROWS, a.shape[-1])  # noqa: E731
        plain = deinterleave_xla(*map(flat, arrays), self.format.bits)
        pick = jnp.arange(count) * ROWS + lane
        return QuantizedWeight(
            quants=plain[0][pick],
            scales=plain[1][pick],
            offsets=None if plain[2] is None else plain[2][pick],
            format=PLAIN[self.format.name],
            shape=(count, *self.shape[1:]),
        )


def interleaved_blocks(
    arrays: BlockArrays, fmt: BlockFormat, shape: tuple[int, ...]
) -> tuple[BlockArrays, BlockFormat]:
    """A weight's numpy `arrays` and `fmt` in the interleaved layout of the int8-rows products
    (formats.py, "Interleaved"), or as they are where `fmt` and `shape` have none."""
    if fmt.interleaved or not interleavable(fmt, tuple(shape)):
        return arrays, fmt
    return interleave(arrays, fmt), INTERLEAVED[fmt.name]


def interleaved_weight(w: QuantizedWeight) -> QuantizedWeight:
    """`w` in its format's interleaved layout (`interleaved_blocks`), or `w` itself."""
    if w.format.interleaved or not interleavable(w.format, w.shape):
        return w
    host = (None if a is None else np.asarray(a) for a in (w.quants, w.scales, w.offsets))
    return from_block_arrays(*interleaved_blocks(BlockArrays(*host), w.format, w.shape), w.shape)


def _nbytes(a) -> int:
    return math.prod(a.shape) * np.dtype(a.dtype).itemsize


def from_block_arrays(arrays: BlockArrays, fmt: BlockFormat, shape: tuple[int, ...]):
    """A `QuantizedWeight` of numpy `arrays` (formats.py), placed on the default device. For
    stacked experts, `shape` [E, out, in]: arrays of E * out rows (expert 0's rows first) are
    given the leading expert axis."""

    def put(a):
        return None if a is None else jax.device_put(a.reshape(*shape[:-1], a.shape[-1]))

    return QuantizedWeight(
        quants=put(arrays.quants),
        scales=put(arrays.scales),
        offsets=put(arrays.offsets),
        format=fmt,
        shape=tuple(shape),
    )


def gguf_blocks(
    data: np.ndarray, type_name: str, shape: tuple[int, int]
) -> tuple[BlockFormat, BlockArrays]:
    """The block format and arrays of a GGUF tensor of type `type_name` (one of
    GGUF_BLOCK_TYPES) from its raw bytes `data` [out, row bytes] (rows in etjax's order)."""
    return GGUF_FORMATS[type_name], from_gguf(data, type_name, shape)


def concatenate_rows(pieces: list[BlockArrays]) -> BlockArrays:
    """Blocks of matrices of one format stacked along their output axis (q|k|v, gate|up), as
    `output_major` stacks float parts."""
    cat = lambda arrays: np.concatenate(arrays, axis=0)  # noqa: E731
    return BlockArrays(
        cat([p.quants for p in pieces]),
        cat([p.scales for p in pieces]),
        None if pieces[0].offsets is None else cat([p.offsets for p in pieces]),
    )


def int8_weight(w: np.ndarray) -> QuantizedWeight:
    """Symmetric int8 per output channel of a float matrix w [out, in], or of each expert's of
    stacked experts [E, out, in] (formats.py `quantize_int8`: |w - dequantized| <= scale / 2
    per channel)."""
    return from_block_arrays(quantize_int8(w.reshape(-1, w.shape[-1])), INT8, w.shape)


def abstract_quantized(fmt: BlockFormat, shape: tuple[int, ...]) -> QuantizedWeight:
    """A `QuantizedWeight` of `jax.ShapeDtypeStruct`s: what a weight of `fmt` and `shape`
    ([out, in], or stacked experts' [E, out, in]) holds (a checkpoint's restore target, the
    planner's byte counts)."""
    *lead, width = shape
    block = fmt.block_size(width)
    quants = (*lead, width // 2) if fmt.bits == 4 else (*lead, width)
    qdtype = jnp.uint8 if fmt.bits == 4 else jnp.int8
    scales = jax.ShapeDtypeStruct((*lead, width // block), jnp.dtype(fmt.scale_dtype))
    return QuantizedWeight(
        quants=jax.ShapeDtypeStruct(quants, qdtype),
        scales=scales,
        offsets=scales if fmt.offsets else None,
        format=fmt,
        shape=tuple(shape),
    )


def is_quantized(w: object) -> bool:
    """Whether `w` is a `QuantizedWeight` leaf."""
    return isinstance(w, QuantizedWeight)


def embedding_rows(table, tokens: jax.Array, dtype) -> jax.Array:
    """The embedding rows of `tokens` [T] in `dtype` -> [T, D]: gathered first, so a quantized
    table dequantizes T rows, never the vocabulary."""
    if isinstance(table, QuantizedWeight):
        if tokens.shape[0] == 1:
            # One row is gathered as two: to gather a single row of a large int8 table, XLA:TPU
            # copied the whole table into another tiling every step (Llama-3.1-8B's 0.53 GB;
            # docs/TPU.md, "int8 weights"), and reads it where it lies for two rows or more.
            pair = jnp.concatenate([tokens, tokens])
            return table.take_rows(pair).dequantize(dtype)[:1]
        return table.take_rows(tokens).dequantize(dtype)
    return table[tokens].astype(dtype)


def weights_bytes(weights) -> int:
    """Bytes every array of a weights pytree holds (a quantized leaf: its blocks)."""
    return sum(_nbytes(leaf) for leaf in jax.tree.leaves(weights))


def weight_formats(weights) -> dict[str, str]:
    """Each quantized leaf's pytree path (`jax.tree_util.keystr`) and format name."""
    found = jax.tree_util.tree_flatten_with_path(weights, is_leaf=is_quantized)[0]
    return {
        jax.tree_util.keystr(path): leaf.format.name
        for path, leaf in found
        if isinstance(leaf, QuantizedWeight)
    }


def dequantize_weights(weights, dtype=jnp.float32):
    """`weights` with every quantized leaf replaced by its float matrix in `dtype` (the float
    model a quantized one computes: its reference)."""

    def dequantized(w):
        return w.dequantize(dtype) if isinstance(w, QuantizedWeight) else w

    return jax.tree.map(dequantized, weights, is_leaf=is_quantized)
