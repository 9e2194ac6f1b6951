"""Read a model (config and weights) from a GGUF file.

The file's `general.architecture` picks the family (etjax/model/families/), whose table names
the tensors every leaf is built from; this module reads the config and finds the tensors. The
header is read by `gguf_file.py`, the tensors dequantized by the `gguf` package.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from etjax.errors import EtjaxError, ModelLoadError, shown
from etjax.gguf_file import GGUFFile, read_gguf
from etjax.loaders.assemble import SourceTensor, assemble_weights
from etjax.loaders.gguf_rope import gguf_rope_scaling
from etjax.loaders.hf_config import every_layer_windowed
from etjax.model.config import ModelConfig
from etjax.model.families import gguf_architectures, gguf_family
from etjax.model.leaves import Part
from etjax.model.quantized import GGUF_BLOCK_TYPES, BlockArrays, BlockFormat, gguf_blocks
from etjax.model.weights import MODEL_LEAVES, Weights

# `{arch}.expert_gating_func` values (llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE): 1 softmax.
_SOFTMAX_GATING = 1

# Float tensor types: anything else is quantized (blocks weights="stored" may keep).
_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")

# Tensor types are whatever `gguf.quants.dequantize` implements (F32, F16, BF16, the legacy
# Q4/Q5/Q8 blocks and the K-quants); the rest (Q8_1, Q8_K, integer tensors) are refused by name.


def open_gguf(path: Path) -> GGUFFile:
    """Read a GGUF file's header, turning a missing or corrupt file into a `ModelLoadError`."""
    if not path.is_file():
        raise ModelLoadError(f"{path}: GGUF file not found")
    try:
        return read_gguf(path)
    except (OSError, ValueError) as e:
        raise ModelLoadError(
            f"{path}: not a readable GGUF file ({type(e).__name__}: {e})"
        ) from None


def gguf_field(reader: GGUFFile, key: str, default: Any = ...) -> Any:
    """The value of metadata field `key`, or `default`; errors name the file and the key."""
    if key not in reader.fields:
        if default is ...:
            raise ModelLoadError(f"{reader.path}: metadata field {key!r} is missing")
        return default
    return reader.fields[key]


def gguf_count(reader: GGUFFile, key: str, default: Any = ..., minimum: int = 1) -> int:
    """Metadata field `key` (or `default`) as an integer >= `minimum`: a size that divides or
    shapes an array, refused by name when 0 or negative rather than met as a
    ZeroDivisionError further on."""
    value = gguf_field(reader, key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ModelLoadError(
            f"{reader.path}: {key}={shown(value)}; must be an integer >= {minimum}"
        )
    return value


def gguf_model_config(reader: GGUFFile, dtype: str) -> ModelConfig:
    """Build the `ModelConfig` from the `{arch}.*` metadata of a GGUF file; a value it
    cannot take is a `ModelLoadError` naming the file and the key (or `ModelConfig`'s
    field)."""
    try:
        return _model_config(reader, dtype)
    except ModelLoadError:
        raise
    except EtjaxError as e:  # ModelConfig's own checks, naming its field
        raise ModelLoadError(f"{reader.path}: {e}") from None
    except (TypeError, ValueError, ArithmeticError, LookupError) as e:
        # A key of an unexpected kind (a list where a number belongs) no check above named.
        raise ModelLoadError(
            f"{reader.path}: a metadata field holds a value etjax cannot read "
            f"({type(e).__name__}: {e})"
        ) from None


def _model_config(reader: GGUFFile, dtype: str) -> ModelConfig:
    arch = gguf_field(reader, "general.architecture")
    allowed = gguf_architectures()
    if arch not in allowed:
        raise ModelLoadError(
            f"{reader.path}: general.architecture={arch!r} is not supported; allowed: {allowed}"
        )
    num_experts = gguf_count(reader, f"{arch}.expert_count", 0, minimum=0)
    fam = gguf_family(arch, routed_experts=num_experts > 0)
    if fam is None:
        with_experts = tuple(a for a in allowed if gguf_family(a, True))
        if num_experts:
            raise ModelLoadError(
                f"{reader.path}: {arch}.expert_count={num_experts} (a mixture of experts) is "
                f"not supported for general.architecture={arch!r}; etjax reads routed experts "
                f"from: {with_experts}"
            )
        raise ModelLoadError(
            f"{reader.path}: {arch}.expert_count is missing or 0; general.architecture="
            f"{arch!r} has routed experts (llama.cpp requires them)"
        )
    num_heads = gguf_count(reader, f"{arch}.attention.head_count")
    hidden = gguf_count(reader, f"{arch}.embedding_length")
    tensor_names = {t.name for t in reader.tensors}
    head_dim = gguf_count(
        reader,
        f"{arch}.attention.key_length",
        gguf_count(reader, f"{arch}.rope.dimension_count", hidden // num_heads),
    )
    num_layers = gguf_count(reader, f"{arch}.block_count")
    rope_scaling, max_positions = gguf_rope_scaling(
        reader, arch, fam.name, head_dim, gguf_count(reader, f"{arch}.context_length", 4096)
    )
    window = {}
    if fam.name == "gemma3":
        window = _gemma3_window(reader, arch, num_layers, head_dim)
    elif fam.name == "gemma2":
        window = _gemma2_window(reader, arch, num_layers, head_dim, hidden // num_heads)
    elif fam.name == "phi3":  # Phi-3's window covers every layer
        sliding = gguf_field(reader, f"{arch}.attention.sliding_window", None)
        window = every_layer_windowed(sliding, num_layers, max_positions)
    experts = {}
    if num_experts:
        experts = _expert_fields(reader, arch, num_experts, num_layers, tensor_names)
    return ModelConfig(
        vocab_size=_vocab_size(reader, arch),
        hidden_size=hidden,
        intermediate_size=gguf_count(reader, f"{arch}.feed_forward_length", minimum=0),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=_kv_heads(reader, arch, num_heads),
        head_dim=head_dim,
        rope_theta=float(gguf_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        rms_norm_eps=float(gguf_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=max_positions,
        # Optional leaves are there when their tensors are (the first part, of layer 0).
        tie_word_embeddings=(fam.model or MODEL_LEAVES)["lm_head"].parts[0].gguf_name(None)
        not in tensor_names,
        attention_bias="bqkv" in fam.layer
        and fam.layer["bqkv"].parts[0].gguf_name(0) in tensor_names,
        dtype=dtype,
        architecture=fam.name,
        **window,
        **experts,
    )


def _expert_fields(
    reader: GGUFFile, arch: str, num_experts: int, num_layers: int, tensor_names: set[str]
) -> dict:
    # What llama.cpp's `llama` (Mixtral) and `qwen3moe` graphs compute, and so what their files
    # mean: every layer routes (a router in each), a softmax over the E experts, the top k
    # renormalised to sum to 1, unscaled, no shared expert. A file that says otherwise is
    # refused by the key or tensors that say it. Qwen3-MoE's dense layers (`mlp_only_layers`,
    # `decoder_sparse_step`) cannot be written (the converter has no name for their tensors);
    # `norm_topk_prob` false is not recorded, so such a model's file is read as llama.cpp
    # runs it, renormalised (every released Qwen3-MoE renormalises).
    field = functools.partial(gguf_field, reader)
    top_k = gguf_count(reader, f"{arch}.expert_used_count")
    if top_k > num_experts:
        raise ModelLoadError(
            f"{reader.path}: {arch}.expert_used_count={top_k}; must be 1..{num_experts} "
            f"({arch}.expert_count)"
        )
    checks = (  # key, its value when absent, the one value allowed, what that means
        ("expert_gating_func", _SOFTMAX_GATING, "1 (softmax)"),
        ("expert_weights_norm", True, "true (the top k renormalised)"),
        ("expert_weights_scale", 1.0, "1.0 (unscaled)"),
        ("expert_shared_count", 0, "0 (no shared expert)"),
        ("leading_dense_block_count", 0, "0 (every layer routed)"),
    )
    for key, default, allowed in checks:
        value = field(f"{arch}.{key}", default)
        if value != default:
            raise ModelLoadError(
                f"{reader.path}: {arch}.{key}={value!r} is not supported; allowed: {allowed}"
            )
    shared = sorted(n for n in tensor_names if "_shexp." in n)
    if shared:
        raise ModelLoadError(
            f"{reader.path}: shared-expert tensors ({shared[0]}, ...) are not supported"
        )
    routerless = [
        i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names
    ]
    if routerless:
        raise ModelLoadError(
            f"{reader.path}: layers {routerless} have no router (blk.N.ffn_gate_inp.weight); "
            f"dense layers in a mixture of experts are not supported in GGUF ({arch} routes "
            "every layer); load the Hugging Face directory of the model instead"
        )
    # llama.cpp's Mixtral (`llama`) gives its experts the model's feed-forward width;
    # `qwen3moe` its own key, else that width over k, as llama.cpp falls back.
    width = gguf_count(reader, f"{arch}.feed_forward_length", minimum=0)
    if arch != "llama":
        width = gguf_count(reader, f"{arch}.expert_feed_forward_length", width // top_k)
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=width,
        norm_topk_prob=True,
    )


def _gemma3_window(reader: GGUFFile, arch: str, num_layers: int, head_dim: int) -> dict:
    # llama.cpp's Gemma 3: every sixth layer is global, the others see the last
    # `attention.sliding_window` positions and rotate with base 10000 (not stored in the file,
    # as transformers assumes too); the query scale is head_dim ** -0.5.
    pattern = gguf_count(reader, f"{arch}.attention.sliding_window_pattern", 6)
    if gguf_field(reader, f"{arch}.final_logit_softcapping", None) is not None:
        raise ModelLoadError(f"{reader.path}: {arch}.final_logit_softcapping is not supported")
    return dict(
        sliding_window=gguf_count(reader, f"{arch}.attention.sliding_window"),
        local_layers=tuple(i for i in range(num_layers) if (i + 1) % pattern),
        rope_local_theta=10000.0,
        query_pre_attn_scalar=float(head_dim),
    )


def _gemma2_window(
    reader: GGUFFile, arch: str, num_layers: int, head_dim: int, hidden_per_head: int
) -> dict:
    # llama.cpp's Gemma 2: even layers see the last `attention.sliding_window` positions, one
    # RoPE base for all, the soft caps in the metadata. The file stores no query scale:
    # llama.cpp takes hidden / heads for the 27B model (46 layers), head_dim otherwise.
    cap = functools.partial(gguf_field, reader, default=0.0)
    rope_theta = float(gguf_field(reader, f"{arch}.rope.freq_base", 10000.0))
    return dict(
        sliding_window=gguf_count(reader, f"{arch}.attention.sliding_window"),
        local_layers=tuple(range(0, num_layers, 2)),
        rope_local_theta=rope_theta,
        query_pre_attn_scalar=float(hidden_per_head if num_layers == 46 else head_dim),
        attn_logit_softcapping=float(cap(f"{arch}.attn_logit_softcapping") or 0.0),
        final_logit_softcapping=float(cap(f"{arch}.final_logit_softcapping") or 0.0),
    )


def _kv_heads(reader: GGUFFile, arch: str, num_heads: int) -> int:
    key = f"{arch}.attention.head_count_kv"
    kv_heads = gguf_count(reader, key, num_heads)
    if num_heads % kv_heads:
        raise ModelLoadError(
            f"{reader.path}: {key}={kv_heads}; must divide {arch}.attention.head_count={num_heads}"
        )
    return kv_heads


def _vocab_size(reader: GGUFFile, arch: str) -> int:
    if gguf_field(reader, f"{arch}.vocab_size", None) is not None:
        return gguf_count(reader, f"{arch}.vocab_size")
    return len(gguf_field(reader, "tokenizer.ggml.tokens"))


@dataclass(frozen=True)
class _StoredTensor:
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # Hugging Face order: GGUF lists the fastest axis first
    offset: int  # of the tensor's first byte in the file
    data_dtype: np.dtype  # what the reader's view of the bytes holds: uint8 blocks if quantized
    data_shape: tuple[int, ...]  # that view's shape; the first axis is the tensor's rows


@dataclass(frozen=True)
class GGUFTensors:
    """Where each tensor of a GGUF file lies: enough to read the weights without the reader.

    The metadata (a vocabulary of Python strings, tens of MB for 262k tokens) can be dropped
    once the config and tokenizer are read, keeping it off the weights' peak.
    """

    path: Path
    stored: dict[str, _StoredTensor]


def gguf_tensors(reader: GGUFFile) -> GGUFTensors:
    """The tensor table of a GGUF file (names, types, shapes, offsets)."""
    stored = {
        t.name: _StoredTensor(
            tensor_type=t.tensor_type,
            shape=tuple(reversed(t.dims)),
            offset=t.data_offset,
            data_dtype=t.data_dtype,
            data_shape=t.data_shape,
        )
        for t in reader.tensors
    }
    return GGUFTensors(path=reader.path, stored=stored)


def gguf_matrix_types(tensors: GGUFTensors) -> frozenset[str]:
    """The quantized types of a GGUF file's matrices ("Q4_1", ...; empty for a float file):
    what weights="auto" reads (etjax/model/quantized.py `auto_weights`)."""
    return frozenset(
        t.tensor_type.name
        for t in tensors.stored.values()
        if len(t.shape) == 2 and t.tensor_type.name not in _FLOAT_TYPES
    )


def load_gguf_weights(
    tensors: GGUFTensors, cfg: ModelConfig, weights: str | None = None, strict: bool = True
) -> Weights:
    """Dequantize every tensor and fuse it into etjax's layout, in `cfg.dtype`; `weights`
    says how the matrices are held instead (etjax/loaders/assemble.py): with "stored", a
    quantized matrix keeps its blocks, read raw and converted by
    pallas_kernels/block_products/formats.py (its rows reordered like the float rows, which
    moves whole rows of blocks and loses nothing); unless `strict`, a matrix "stored" cannot
    keep as blocks loads as floats in `cfg.dtype` instead of being refused.

    Each tensor is dequantized to float32 a chunk of rows at a time and written straight into
    its final leaf (etjax/loaders/assemble.py), so no float32 copy of the model is ever held.
    Where the family's table says llama.cpp interleaved a q or k projection's rows per head for
    its adjacent-pair RoPE (`Part.gguf_rope_heads`, the `llama` architecture), they are read
    back in the Hugging Face half-split order that `apply_rope` uses.
    """

    def find(part: Part, layer: int | None) -> SourceTensor:
        if part.expert is not None and "{e}" not in part.gguf:
            return _expert_slice(tensors, part.gguf_name(layer), part.expert, cfg.num_experts)
        name = part.gguf_name(layer)
        stored = tensors.stored.get(name)
        if stored is None:
            raise ModelLoadError(f"{tensors.path}: tensor {name!r} is missing")
        order = np.arange(stored.shape[0])
        if part.gguf_rope_heads is not None:
            order = _rope_rows(order, getattr(cfg, part.gguf_rope_heads))
        read = functools.partial(_read_rows, tensors.path, name, stored, order)
        return _source(tensors.path, name, stored, order, read, name)

    return assemble_weights(cfg, find, str(tensors.path), weights, strict)


def _expert_slice(tensors: GGUFTensors, name: str, expert: int, num_experts: int) -> SourceTensor:
    # Expert `expert`'s matrix [out, in] of llama.cpp's stacked tensor `name` [E, out, in]: its
    # rows e * out ... (e + 1) * out, the stacked tensor's leading axes read as one. Mixtral
    # files written before llama.cpp stacked its experts (April 2024) hold each expert's
    # matrix on its own, named with ".{e}" where the stacked name has "_exps".
    stored = tensors.stored.get(name)
    if stored is None:
        split = name.replace("_exps.", f".{expert}.")
        if split in tensors.stored:
            single = tensors.stored[split]
            order = np.arange(single.shape[0])
            read = functools.partial(_read_rows, tensors.path, split, single, order)
            return _source(tensors.path, split, single, order, read, split)
        fused = f"{name.rsplit('.ffn_', 1)[0]}.ffn_gate_up_exps.weight"
        if fused in tensors.stored:
            raise ModelLoadError(
                f"{tensors.path}: tensor {fused!r} (gate and up experts fused, the converter's "
                "--fuse-gate-up-exps) is not supported; allowed: ffn_gate_exps and ffn_up_exps"
            )
        raise ModelLoadError(f"{tensors.path}: tensor {name!r} is missing")
    if len(stored.shape) != 3 or stored.shape[0] != num_experts:
        raise ModelLoadError(
            f"{tensors.path}: tensor {name!r} has shape {stored.shape}; expected "
            f"[{num_experts}, out, in] (the experts stacked)"
        )
    _, out, *inner = stored.shape
    rows = dataclasses.replace(
        stored,
        shape=(num_experts * out, *inner),
        data_shape=(num_experts * out, *stored.data_shape[2:]),
    )
    order = np.arange(expert * out, (expert + 1) * out)
    read = functools.partial(_read_rows, tensors.path, name, rows, order)
    return _source(tensors.path, name, rows, order, read, f"{name}[{expert}]", (out, *inner))


def _source(
    path: Path,
    name: str,
    stored: _StoredTensor,
    order: np.ndarray,
    read,
    label: str,
    shape: tuple[int, ...] | None = None,
) -> SourceTensor:
    # The tensor of rows `order` of `stored`: with its block type where it is quantized, and
    # its blocks where the kernels read them (a matrix's rows, or an expert's of stacked ones).
    shape = stored.shape if shape is None else shape
    type_name = stored.tensor_type.name
    if type_name in _FLOAT_TYPES:
        return SourceTensor(label, shape, read)
    blocks = None
    if type_name in GGUF_BLOCK_TYPES and len(shape) == 2:
        blocks = functools.partial(_read_blocks, path, name, stored, order)
    return SourceTensor(label, shape, read, block_type=type_name, blocks=blocks)


def _read_rows(
    path: Path, name: str, stored: _StoredTensor, order: np.ndarray, rows_per_chunk: int
) -> Iterator[np.ndarray]:
    # Yields the stored rows `order[start:stop]` of each chunk, dequantized: [rows, *shape[1:]]
    # float32. The rows of a chunk span at most one head more than the chunk (`_rope_rows`).
    # Plain file reads rather than the reader's memory map: every page a map touches stays
    # resident, and counted as this process's memory, until the map closes.
    with open(path, "rb") as file:
        if len(stored.data_shape) == 1:  # a norm or bias: small, so read whole
            file.seek(stored.offset)
            block = np.fromfile(file, stored.data_dtype, stored.data_shape[0])
            values = _dequantize(block, stored.tensor_type, path, name)
            yield values.reshape(stored.shape).astype(np.float32, copy=False)
            return
        row_items = math.prod(stored.data_shape[1:])
        row_bytes = row_items * stored.data_dtype.itemsize
        for start in range(0, len(order), rows_per_chunk):
            wanted = order[start : start + rows_per_chunk]
            first, end = int(wanted.min()), int(wanted.max()) + 1
            file.seek(stored.offset + first * row_bytes)
            block = np.fromfile(file, stored.data_dtype, (end - first) * row_items)
            block = block.reshape(end - first, *stored.data_shape[1:])[wanted - first]
            values = _dequantize(block, stored.tensor_type, path, name)
            yield values.reshape(len(wanted), *stored.shape[1:]).astype(np.float32, copy=False)


def _read_blocks(
    path: Path, name: str, stored: _StoredTensor, order: np.ndarray
) -> tuple[BlockFormat, BlockArrays]:
    # The tensor's raw blocks, its rows in `order`, as the kernels' arrays (formats.py). Only
    # the rows from the least of `order` to the greatest are read: an expert's of stacked
    # experts, not the whole tensor once per expert.
    row_bytes = math.prod(stored.data_shape[1:]) * stored.data_dtype.itemsize
    first, end = int(order.min()), int(order.max()) + 1
    with open(path, "rb") as file:
        file.seek(stored.offset + first * row_bytes)
        raw = np.fromfile(file, np.uint8, (end - first) * row_bytes)
    try:
        raw = raw.reshape(end - first, row_bytes)[order - first]
        return gguf_blocks(raw, stored.tensor_type.name, (len(order), *stored.shape[1:]))
    except ValueError as e:  # a truncated file, or a row that is not whole blocks
        raise ModelLoadError(f"{path}: tensor {name!r}: {e}") from None


def _dequantize(
    block: np.ndarray, tensor_type: GGMLQuantizationType, path: Path, name: str
) -> np.ndarray:
    try:
        return dequantize(block, tensor_type)
    except NotImplementedError:
        raise ModelLoadError(
            f"{path}: tensor {name!r} has type {tensor_type.name}, which the gguf "
            "package cannot dequantize; allowed: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 "
            "and the K-quants (Q2_K..Q6_K)"
        ) from None


def _rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    # Within each head llama.cpp orders rows (0, hd/2, 1, hd/2+1, ...); restore (0, 1, ..., hd-1).
    head_dim = w.shape[0] // num_heads
    return w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
