"""Read Llama-family weights from Hugging Face safetensors files (single or sharded)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors import safe_open

from etjax.errors import ModelLoadError
from etjax.model.config import ModelConfig
from etjax.model.weights import Weights, layer_from_projections, weights_to_device

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
    """Load and fuse the weights of a Hugging Face Llama/Mistral/Qwen2 directory."""
    tensors = _read_all(safetensors_files(directory))

    def take(name: str) -> np.ndarray:
        try:
            return tensors.pop(name)
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
            layer_from_projections(
                attn_norm=take(p + "input_layernorm.weight"),
                wq=take(p + "self_attn.q_proj.weight"),
                wk=take(p + "self_attn.k_proj.weight"),
                wv=take(p + "self_attn.v_proj.weight"),
                wo=take(p + "self_attn.o_proj.weight"),
                mlp_norm=take(p + "post_attention_layernorm.weight"),
                w_gate=take(p + "mlp.gate_proj.weight"),
                w_up=take(p + "mlp.up_proj.weight"),
                w_down=take(p + "mlp.down_proj.weight"),
                **bias,
            )
        )
    embed = take("model.embed_tokens.weight")
    lm_head = None if cfg.tie_word_embeddings else tensors.pop("lm_head.weight", None)
    if lm_head is None and not cfg.tie_word_embeddings:
        raise ModelLoadError(f"{directory}: tensor 'lm_head.weight' is missing (untied model)")
    return weights_to_device(
        embed=embed, layers=layers, final_norm=take("model.norm.weight"), lm_head=lm_head, cfg=cfg
    )


def _read_all(files: list[Path]) -> dict[str, np.ndarray]:
    tensors: dict[str, np.ndarray] = {}
    for path in files:
        try:
            # The flax framework reads bfloat16, which plain numpy cannot represent.
            with safe_open(str(path), framework="flax") as f:
                for name in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                    tensors[name] = np.asarray(f.get_tensor(name), dtype=np.float32)
        except Exception as e:  # safetensors raises its own untyped errors for corrupt files
            raise ModelLoadError(f"{path}: cannot read safetensors file ({e})") from None
    return tensors
