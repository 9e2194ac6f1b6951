"""Read a Llama-family model (config and weights) from a GGUF file with the `gguf` package."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

from etjax.errors import ModelLoadError
from etjax.model.config import ModelConfig
from etjax.model.weights import Weights, layer_from_projections, weights_to_device

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
# Tensor types are whatever `gguf.quants.dequantize` implements (F32, F16, BF16, the legacy
# Q4/Q5/Q8 blocks and the K-quants); the rest (Q8_1, Q8_K, integer tensors) are refused by name.


def open_gguf(path: Path) -> GGUFReader:
    """Open a GGUF file, turning a missing or corrupt file into a `ModelLoadError`."""
    if not path.is_file():
        raise ModelLoadError(f"{path}: GGUF file not found")
    try:
        return GGUFReader(path)
    except Exception as e:  # the reader raises ValueError, struct.error, IndexError, ...
        raise ModelLoadError(
            f"{path}: not a readable GGUF file ({type(e).__name__}: {e})"
        ) from None


def gguf_field(reader: GGUFReader, key: str, default: Any = ...) -> Any:
    """The value of metadata field `key`, or `default`; errors name the file and the key."""
    field = reader.fields.get(key)
    if field is None:
        if default is ...:
            raise ModelLoadError(f"{reader.data.filename}: metadata field {key!r} is missing")
        return default
    return field.contents()


def gguf_model_config(reader: GGUFReader, dtype: str) -> ModelConfig:
    """Build the `ModelConfig` from the `{arch}.*` metadata of a GGUF file."""
    arch = gguf_field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{reader.data.filename}: general.architecture={arch!r} is not supported; "
            f"allowed: {SUPPORTED_ARCHITECTURES}"
        )
    if "rope_freqs.weight" in {t.name for t in reader.tensors}:
        raise ModelLoadError(
            f"{reader.data.filename}: per-frequency RoPE factors (rope_freqs, Llama 3.1 scaling) "
            "are not supported in GGUF; load the Hugging Face directory of the model instead"
        )
    num_heads = int(gguf_field(reader, f"{arch}.attention.head_count"))
    hidden = int(gguf_field(reader, f"{arch}.embedding_length"))
    tensor_names = {t.name for t in reader.tensors}
    return ModelConfig(
        vocab_size=_vocab_size(reader, arch),
        hidden_size=hidden,
        intermediate_size=int(gguf_field(reader, f"{arch}.feed_forward_length")),
        num_layers=int(gguf_field(reader, f"{arch}.block_count")),
        num_heads=num_heads,
        num_kv_heads=int(gguf_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=int(gguf_field(reader, f"{arch}.rope.dimension_count", hidden // num_heads)),
        rope_theta=float(gguf_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(gguf_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(gguf_field(reader, f"{arch}.context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        dtype=dtype,
    )


def _vocab_size(reader: GGUFReader, arch: str) -> int:
    size = gguf_field(reader, f"{arch}.vocab_size", None)
    if size is not None:
        return int(size)
    return len(reader.fields["tokenizer.ggml.tokens"].data)


def load_gguf_weights(reader: GGUFReader, cfg: ModelConfig) -> Weights:
    """Dequantize every tensor to float32 and fuse it into etjax's layout.

    For the `llama` architecture GGUF stores the q and k projections with each head's rows
    interleaved for llama.cpp's adjacent-pair RoPE; they are un-permuted back to the Hugging Face
    half-split layout that `apply_rope` uses. `qwen2` files use half-split RoPE and are stored
    as they are.
    """
    interleaved = gguf_field(reader, "general.architecture") == "llama"
    tensors = {t.name: t for t in reader.tensors}
    source = reader.data.filename

    def take(name: str) -> np.ndarray:
        tensor = tensors.get(name)
        if tensor is None:
            raise ModelLoadError(f"{source}: tensor {name!r} is missing")
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists the fastest axis first
        try:
            values = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError:
            raise ModelLoadError(
                f"{source}: tensor {name!r} has type {tensor.tensor_type.name}, which the gguf "
                "package cannot dequantize; allowed: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 "
                "and the K-quants (Q2_K..Q6_K)"
            ) from None
        return values.reshape(shape).astype(np.float32)

    def optional(name: str) -> np.ndarray | None:
        return take(name) if name in tensors else None

    layers = []
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        layers.append(
            layer_from_projections(
                attn_norm=take(p + "attn_norm.weight"),
                wq=_rope_rows(take(p + "attn_q.weight"), cfg.num_heads, interleaved),
                wk=_rope_rows(take(p + "attn_k.weight"), cfg.num_kv_heads, interleaved),
                wv=take(p + "attn_v.weight"),
                wo=take(p + "attn_output.weight"),
                mlp_norm=take(p + "ffn_norm.weight"),
                w_gate=take(p + "ffn_gate.weight"),
                w_up=take(p + "ffn_up.weight"),
                w_down=take(p + "ffn_down.weight"),
                bq=optional(p + "attn_q.bias"),
                bk=optional(p + "attn_k.bias"),
                bv=optional(p + "attn_v.bias"),
            )
        )
    return weights_to_device(
        embed=take("token_embd.weight"),
        layers=layers,
        final_norm=take("output_norm.weight"),
        lm_head=optional("output.weight"),
        cfg=cfg,
    )


def _rope_rows(w: np.ndarray, num_heads: int, interleaved: bool) -> np.ndarray:
    # Within each head llama.cpp orders rows (0, hd/2, 1, hd/2+1, ...); restore (0, 1, ..., hd-1).
    if not interleaved:
        return w
    head_dim = w.shape[0] // num_heads
    return w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
