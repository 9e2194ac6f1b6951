"""Converted checkpoints: `etjax convert SRC DST` saves a loaded model with orbax for fast reload.

Layout of DST:
  etjax_model.json   format version, model name and ModelConfig fields
  weights/           the `Weights` pytree, saved by orbax-checkpoint (already fused, dequantized)
  tokenizer/         tokenizer.json and tokenizer_config.json

Restoring reads the weights straight into their final layout: no GGUF dequantization or
projection fusing, which dominate the cost of loading a GGUF or safetensors model.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from etjax.distributed.placement import Placement
from etjax.errors import ModelLoadError
from etjax.loaders.loaded_model import Model
from etjax.model.config import Llama3RopeScaling, ModelConfig
from etjax.model.weights import LayerWeights, Weights
from etjax.tokenizer import Tokenizer

FORMAT_VERSION = 1
_MANIFEST = "etjax_model.json"


def is_etjax_checkpoint(path: Path) -> bool:
    """Whether `path` is a directory written by `save_model`."""
    return (path / _MANIFEST).is_file()


def save_model(model: Model, destination: Path) -> None:
    """Write `model` to `destination` (created; must not already hold a checkpoint)."""
    destination = destination.expanduser().absolute()
    if destination.exists() and any(destination.iterdir()):
        raise ModelLoadError(f"{destination}: destination exists and is not empty")
    destination.mkdir(parents=True, exist_ok=True)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(destination / "weights", model.weights)
    checkpointer.wait_until_finished()
    model.tokenizer.save(destination / "tokenizer")
    manifest = {
        "format_version": FORMAT_VERSION,
        "name": model.name,
        "config": dataclasses.asdict(model.config),
    }
    (destination / _MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def restore_model(path: Path, dtype: str, placement: Placement | None = None) -> Model:
    """Load a checkpoint written by `save_model`, casting weights to `dtype` if it differs.

    With a `placement`, every weight is restored straight into its sharding on the mesh: each
    device reads its own slice from the checkpoint, and no device ever holds a full copy of a
    sharded weight.
    """
    path = path.expanduser().absolute()
    manifest_path = path / _MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("format_version") != FORMAT_VERSION:
            raise ModelLoadError(
                f"{manifest_path}: format_version={manifest.get('format_version')!r}; "
                f"this etjax reads version {FORMAT_VERSION}"
            )
        raw = dict(manifest["config"])
        if raw.get("rope_scaling"):
            raw["rope_scaling"] = Llama3RopeScaling(**raw["rope_scaling"])
        saved_cfg = ModelConfig(**raw)
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{manifest_path}: malformed etjax manifest ({e})") from None
    target = abstract_weights(saved_cfg)
    if placement is not None:
        target = jax.tree.map(
            lambda spec, sharding: jax.ShapeDtypeStruct(spec.shape, spec.dtype, sharding=sharding),
            target,
            placement.weights(target),
        )
    try:
        weights = ocp.StandardCheckpointer().restore(path / "weights", target)
    except Exception as e:  # orbax raises many types for missing or damaged files
        raise ModelLoadError(f"{path / 'weights'}: cannot restore weights ({e})") from None
    cfg = saved_cfg.with_dtype(dtype)
    if dtype != saved_cfg.dtype:
        weights = _cast_weights(weights, cfg)
    tokenizer = Tokenizer.from_hf_dir(path / "tokenizer")
    return Model(cfg, weights, tokenizer, name=manifest.get("name", path.name), source=path)


def abstract_weights(cfg: ModelConfig) -> Weights:
    """A `Weights` tree of `jax.ShapeDtypeStruct`s describing a model with this config."""
    d, f, dtype = cfg.hidden_size, cfg.intermediate_size, cfg.jnp_dtype

    def spec(*shape: int, f32: bool = False) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, jnp.float32 if f32 else dtype)

    layer = LayerWeights(
        attn_norm=spec(d, f32=True),
        wqkv=spec(d, cfg.qkv_size),
        bqkv=spec(cfg.qkv_size) if cfg.attention_bias else None,
        wo=spec(cfg.num_heads * cfg.head_dim, d),
        mlp_norm=spec(d, f32=True),
        w_gate_up=spec(d, 2 * f),
        w_down=spec(f, d),
    )
    return Weights(
        embed=spec(cfg.vocab_size, d),
        layers=tuple(layer for _ in range(cfg.num_layers)),
        final_norm=spec(d, f32=True),
        lm_head=None if cfg.tie_word_embeddings else spec(d, cfg.vocab_size),
    )


def _cast_weights(weights: Weights, cfg: ModelConfig) -> Weights:
    # Norm scales stay float32 (see weights_to_device); everything else takes the new dtype.
    target = abstract_weights(cfg)
    return jax.tree.map(lambda w, t: w.astype(t.dtype), weights, target)
