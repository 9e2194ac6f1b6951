"""Read Llama-family weights from Hugging Face safetensors files (single or sharded)."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes  # noqa: F401 (registers bfloat16 with numpy, for safetensors' numpy reads)
import numpy as np
from safetensors import safe_open

from etjax.errors import ModelLoadError
from etjax.loaders.assemble import SourceTensor, assembled_layer, assembled_weights
from etjax.model.config import ModelConfig
from etjax.model.weights import Weights

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


def safetensors_files(directory: Path) -> list[Path]:
    """The weight files of a directory: the shards its index names, or model.safetensors."""
    index = directory / _INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index}: not a valid safetensors index ({e})") from None
        files = sorted({directory / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index}: names shards that are missing: {missing}")
        return files
    if (directory / _SINGLE).is_file():
        return [directory / _SINGLE]
    found = sorted(directory.glob("*.safetensors"))
    if found:
        return found
    raise ModelLoadError(f"{directory}: no *.safetensors weights found")


def load_safetensors_weights(directory: Path, cfg: ModelConfig) -> Weights:
    """Load and fuse the weights of a Hugging Face Llama/Mistral/Qwen2 directory, in `cfg.dtype`.

    Each tensor is read a chunk of rows at a time straight into its final leaf
    (etjax/loaders/assemble.py), so no float32 copy of the model is ever held.
    """
    tensors = _source_tensors(safetensors_files(directory))
    dtype = cfg.jnp_dtype

    def take(name: str) -> SourceTensor:
        try:
            return tensors[name]
        except KeyError:
            raise ModelLoadError(f"{directory}: tensor {name!r} is missing") from None

    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        bias = (
            dict(
                bq=take(p + "self_attn.q_proj.bias"),
                bk=take(p + "self_attn.k_proj.bias"),
                bv=take(p + "self_attn.v_proj.bias"),
            )
            if cfg.attention_bias
            else {}
        )
        layers.append(
            assembled_layer(
                attn_norm=take(p + "input_layernorm.weight"),
                wq=take(p + "self_attn.q_proj.weight"),
                wk=take(p + "self_attn.k_proj.weight"),
                wv=take(p + "self_attn.v_proj.weight"),
                wo=take(p + "self_attn.o_proj.weight"),
                mlp_norm=take(p + "post_attention_layernorm.weight"),
                w_gate=take(p + "mlp.gate_proj.weight"),
                w_up=take(p + "mlp.up_proj.weight"),
                w_down=take(p + "mlp.down_proj.weight"),
                dtype=dtype,
                **bias,
            )
        )
    lm_head = None
    if not cfg.tie_word_embeddings:
        if "lm_head.weight" not in tensors:
            raise ModelLoadError(f"{directory}: tensor 'lm_head.weight' is missing (untied model)")
        lm_head = take("lm_head.weight")
    return assembled_weights(
        embed=take("model.embed_tokens.weight"),
        layers=layers,
        final_norm=take("model.norm.weight"),
        lm_head=lm_head,
        dtype=dtype,
    )


def _source_tensors(files: list[Path]) -> dict[str, SourceTensor]:
    # Every tensor of the files, by name, unread: only the files' headers are parsed.
    tensors: dict[str, SourceTensor] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="numpy") as f:
                for name in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                    shape = tuple(f.get_slice(name).get_shape())
                    read = functools.partial(_read_rows, path, name, shape)
                    tensors[name] = SourceTensor(shape, read)
        except Exception as e:  # safetensors raises its own untyped errors for corrupt files
            raise ModelLoadError(f"{path}: cannot read safetensors file ({e})") from None
    return tensors


def _read_rows(
    path: Path, name: str, shape: tuple[int, ...], rows_per_chunk: int
) -> Iterator[np.ndarray]:
    # The file is opened once per chunk: the pages of its memory map that a read touches stay
    # resident, and counted as this process's memory, until the map closes. bfloat16 rows come
    # back as ml_dtypes arrays and widen to float32 exactly.
    for start in range(0, shape[0], rows_per_chunk):
        stop = min(start + rows_per_chunk, shape[0])  # safetensors refuses a slice past the end
        try:
            with safe_open(str(path), framework="numpy") as f:
                rows = f.get_slice(name)[start:stop]
        except Exception as e:
            raise ModelLoadError(f"{path}: cannot read tensor {name!r} ({e})") from None
        yield np.asarray(rows, dtype=np.float32)
