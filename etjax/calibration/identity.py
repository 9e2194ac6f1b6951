"""The identity of a model, as a calibration file records it: what the fit holds for.

A temperature fitted to one model's logits says nothing of another's, and two models can
share a vocabulary (a base model and its fine-tunes, every size of a family). So a file
records the model's architecture, its sizes and a fingerprint of its weights, and a load
refuses a file whose identity differs (etjax/calibration/file.py).

The fingerprint hashes, from every weight leaf, the leaf's name and shape and a sample of its
values: the whole leaf when small (norms, biases), else its first row (one row of every
projection of every layer, so a fine-tune that moves any of them, a merged LoRA included,
changes it). Values are hashed rounded to bfloat16, the cast etjax's loaders make (round to
nearest even, etjax/loaders/assemble.py), so the same weights give the same fingerprint
whichever dtype they were loaded in and whether they came from safetensors, a GGUF file of
the same values or a converted checkpoint. Weights quantized differently are other weights;
a matrix kept in its blocks (`load_model(weights="stored")`) is hashed as the values it holds,
so it fingerprints as its float32 dequantization does.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from etjax.model.quantized import is_quantized

# A leaf up to this many values is hashed whole; a larger one by its first row.
_WHOLE = 65536
# The ModelConfig fields a file records beside the weights' fingerprint.
_SIZES = (
    "architecture",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "num_experts",
)


def model_identity(model: Any) -> dict[str, str | int]:
    """The identity a calibration file records of `model` (an `etjax.loaders.Model`): its
    architecture and sizes (`ModelConfig` fields) and `weights`, a fingerprint of its weights
    that no load dtype or file format changes."""
    identity: dict[str, str | int] = {name: getattr(model.config, name) for name in _SIZES}
    identity["weights"] = weights_fingerprint(model.weights)
    return identity


def weights_fingerprint(weights: Any) -> str:
    """ "sha256:" and 16 hex digits, from every leaf's name, shape and sampled values."""
    digest = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_leaves_with_path(weights, is_leaf=is_quantized):
        digest.update(f"{jax.tree_util.keystr(path)}{tuple(leaf.shape)};".encode())
        if is_quantized(leaf):  # its values: whole, or its first row, as a float leaf's
            small = math.prod(leaf.shape) <= _WHOLE
            leaf = leaf.dequantize() if small else leaf.take_rows(jnp.zeros(1, jnp.int32))
            leaf = leaf if small else leaf.dequantize()[0]
        digest.update(_sample(leaf).tobytes())
    return "sha256:" + digest.hexdigest()[:16]


def _sample(leaf: jax.Array) -> np.ndarray:
    # The leaf whole, or its first row (index 0 on every axis but the last), as bfloat16.
    piece = leaf if leaf.size <= _WHOLE else leaf[(0,) * (leaf.ndim - 1)]
    if isinstance(piece, jax.Array) and not piece.is_fully_addressable:
        from jax.experimental import multihost_utils  # a leaf sharded over processes

        piece = multihost_utils.process_allgather(piece, tiled=True)
    return np.asarray(piece).astype(np.float32).astype(ml_dtypes.bfloat16)
