"""Converted checkpoints: `etjax convert SRC DST` saves a loaded model with orbax for fast reload.

Layout of DST:
  etjax_model.json   format version, model name and ModelConfig fields
  weights/           the `Weights` pytree, saved by orbax-checkpoint (already fused; matrices
                     quantized or in another dtype than the model's as `load_model(weights=)`
                     held them, which the manifest's "matrices" records)
  tokenizer/         tokenizer.json and tokenizer_config.json

Restoring reads the weights straight into their final layout: no GGUF dequantization or
projection fusing, which dominate the cost of loading a GGUF or safetensors model.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from types import EllipsisType

import jax
import orbax.checkpoint as ocp

from etjax.distributed.placement import Placement
from etjax.errors import ModelLoadError
from etjax.loaders.assemble import reform_weights
from etjax.loaders.loaded_model import Model
from etjax.model.config import ModelConfig, RopeScaling
from etjax.model.quantized import FORMATS, abstract_quantized, is_quantized, weight_formats
from etjax.model.weights import Weights, abstract_weights
from etjax.tokenizer import Tokenizer

# 2: projections stored output-major, [out, in] (etjax/model/leaves.py); version 1 held them
# input-major, and its arrays would restore with the wrong shapes. 3: some matrices held as
# the manifest's "matrices" says (quantized blocks, another dtype); a checkpoint of float
# matrices in the model's dtype is still written as 2, which etjax before 3 reads.
FORMAT_VERSION = 3
_READABLE_VERSIONS = (2, 3)
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
    matrices = _matrices(model.weights, model.config.dtype)
    manifest = {
        "format_version": FORMAT_VERSION if matrices else 2,
        "name": model.name,
        "config": dataclasses.asdict(model.config),
    }
    if matrices:
        manifest["matrices"] = matrices
    (destination / _MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def _matrices(weights: Weights, dtype: str) -> dict[str, str]:
    # Each leaf held otherwise than a float array of the model's dtype (by its pytree path):
    # its block format's name, or its dtype.
    held = weight_formats(weights)
    for key, leaf in jax.tree_util.tree_flatten_with_path(weights, is_leaf=is_quantized)[0]:
        name = jax.tree_util.keystr(key)
        if not is_quantized(leaf) and leaf.ndim == 2 and str(leaf.dtype) != dtype:
            held[name] = str(leaf.dtype)
    return held


def restore_model(
    path: Path, dtype: str, placement: Placement | None = None, storage: str | None = None
) -> Model:
    """Load a checkpoint written by `save_model`, casting weights to `dtype` if it differs;
    its matrices as saved (quantized, another dtype: the manifest's "matrices"), or as
    `storage` says ("int8", "float32", "bfloat16"; None or "stored": as saved).

    With a `placement`, every weight is restored straight into its sharding on the mesh: each
    device reads its own slice from the checkpoint, and no device ever holds a full copy of a
    sharded weight.
    """
    path = path.expanduser().absolute()
    manifest_path = path / _MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("format_version") not in _READABLE_VERSIONS:
            raise ModelLoadError(
                f"{manifest_path}: format_version={manifest.get('format_version')!r}; "
                f"this etjax reads versions {_READABLE_VERSIONS} (convert the model again "
                "with `etjax convert`)"
            )
        matrices = _held_matrices(manifest.get("matrices", {}), manifest_path)
        raw = dict(manifest["config"])
        if raw.get("rope_scaling"):
            # Manifests written before other types existed hold llama3 scaling, untyped.
            scaling = {"rope_type": "llama3", **raw["rope_scaling"]}
            scaling["frequency_factors"] = tuple(scaling.get("frequency_factors", ()))
            raw["rope_scaling"] = RopeScaling(**scaling)
        for name in ("local_layers", "dense_mlp_layers"):  # JSON keeps tuples as lists
            if name in raw:  # and the config is hashable
                raw[name] = tuple(raw[name])
        # Checkpoints written before `architecture` existed hold Llama or Qwen2 weights, which
        # share the layer and its leaf names: "llama", the default, restores both.
        saved_cfg = ModelConfig(**raw)
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise ModelLoadError(f"{manifest_path}: malformed etjax manifest ({e})") from None
    except RecursionError:
        raise ModelLoadError(f"{manifest_path}: JSON nested too deeply to read") from None
    except ModelLoadError:
        raise
    except ValueError as e:  # a field the config refuses, e.g. an architecture of a newer etjax
        raise ModelLoadError(f"{manifest_path}: {e}") from None
    cfg = saved_cfg.with_dtype(dtype)
    # Restored straight into `dtype`: orbax casts each array on the host as it reads it, so a
    # model saved in another dtype is never whole in both.
    target = _restore_target(abstract_weights(cfg), matrices)
    if placement is not None:
        target = jax.tree.map(
            lambda spec, sharding: jax.ShapeDtypeStruct(spec.shape, spec.dtype, sharding=sharding),
            target,
            placement.weights(target),
        )
    try:
        weights = _restore_weights(path / "weights", target)
    except Exception as e:  # orbax raises many types for missing or damaged files
        raise ModelLoadError(f"{path / 'weights'}: cannot restore weights ({e})") from None
    if storage is not None:
        weights = reform_weights(weights, cfg, storage)
    tokenizer = Tokenizer.from_hf_dir(path / "tokenizer")
    return Model(cfg, weights, tokenizer, name=manifest.get("name", path.name), source=path)


def _held_matrices(matrices: object, manifest_path: Path) -> dict[str, str]:
    # The manifest's "matrices": pytree path -> a block format's name or a float dtype.
    allowed = (*FORMATS, "float32", "bfloat16", "float16")
    if not isinstance(matrices, dict) or any(v not in allowed for v in matrices.values()):
        raise ModelLoadError(
            f'{manifest_path}: "matrices" must map weight paths to one of {allowed}'
        )
    return matrices


def _restore_target(target: Weights, matrices: dict[str, str]) -> Weights:
    # The abstract weights with each matrix the manifest lists held as it was saved.
    def held(key, spec):
        name = matrices.get(jax.tree_util.keystr(key))
        if name is None:
            return spec
        if name in FORMATS:
            return abstract_quantized(FORMATS[name], spec.shape)
        return jax.ShapeDtypeStruct(spec.shape, name)

    return jax.tree_util.tree_map_with_path(held, target)


def _restore_weights(directory: Path, target: Weights) -> Weights:
    # Orbax reads every array of a restore at once, each through a host buffer and a copy onto
    # the device; once a large block has been freed, glibc serves blocks under 32 MB from its
    # heap and keeps them when freed, so one restore of the whole tree peaked near 1.4x the
    # weights. Instead: the embedding and lm_head each alone and first, while little else is
    # held (their buffers are large enough to go back to the system when freed), then the rest
    # in one restore with at most twice its largest leaf's bytes in flight.
    leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(target)
    groups = [_restore_group(path) for path, _ in leaves_with_paths]
    rest = [spec for g, (_, spec) in zip(groups, leaves_with_paths, strict=True) if g == "rest"]
    in_flight_bytes = 2 * 4 * max(math.prod(spec.shape) for spec in rest)  # saved float32 at most
    restored: list[jax.Array | None] = [None] * len(groups)
    for group in sorted(set(groups), key=_RESTORE_ORDER.index):
        chosen = [
            spec if g == group else ocp.PLACEHOLDER
            for g, (_, spec) in zip(groups, leaves_with_paths, strict=True)
        ]
        handler = ocp.PyTreeCheckpointHandler(
            # Documented in whole GB; a fraction works and is what a small model needs.
            restore_concurrent_gb=in_flight_bytes / 1e9 if group == "rest" else None
        )
        result = ocp.Checkpointer(handler).restore(
            directory,
            args=ocp.args.PyTreeRestore(
                item=jax.tree.unflatten(treedef, chosen),
                restore_args=jax.tree.unflatten(treedef, [_restore_args(s) for s in chosen]),
            ),
        )
        for i, (g, leaf) in enumerate(zip(groups, jax.tree.leaves(result), strict=True)):
            if g == group:
                restored[i] = leaf
    return jax.tree.unflatten(treedef, restored)


_RESTORE_ORDER = ("embed", "lm_head", "rest")


def _restore_group(path: tuple) -> str:
    # ('embed',) -> "embed", ('lm_head',) -> "lm_head"; ('layers', 3, 'wqkv'), norms -> "rest"
    name = getattr(path[0], "name", None)
    return name if name in _RESTORE_ORDER else "rest"


def _restore_args(spec: jax.ShapeDtypeStruct | EllipsisType) -> ocp.ArrayRestoreArgs | EllipsisType:
    # Orbax casts each array to `spec.dtype` on the host as it reads it.
    if spec is ocp.PLACEHOLDER:
        return spec
    sharding = spec.sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return ocp.ArrayRestoreArgs(sharding=sharding, global_shape=spec.shape, dtype=spec.dtype)
