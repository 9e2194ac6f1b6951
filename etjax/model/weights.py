"""The weights pytree of a Llama-family decoder.

Layers are a tuple of per-layer pytrees rather than arrays stacked on a layer axis: a slice of
a stacked array, static or indexed by a scan, is materialised as a copy before each matrix
product on XLA:CPU, doubling the bytes read per step. The forward pass still loops over layers
with a `lax.scan`, choosing each layer's buffers with `lax.switch` (etjax/model/transformer.py).

Projections are stored input-major (`x @ w`) and fused where they share an input: q|k|v in one
matrix and gate|up in another, so each layer runs two large products instead of five small ones.
"""

from __future__ import annotations

from typing import ClassVar

import flax.struct
import jax

from etjax.model.config import ModelConfig


@flax.struct.dataclass
class LayerWeights:
    """One decoder layer. D = hidden, F = intermediate, Q = qkv width, A = heads * head_dim."""

    attn_norm: jax.Array  # [D]
    wqkv: (
        jax.Array
    )  # [D, Q]  columns: q heads | k heads | v heads, Hugging Face (half-split) RoPE layout
    bqkv: jax.Array | None  # [Q] or None (only Qwen2-style attention_bias)
    wo: jax.Array  # [A, D]
    mlp_norm: jax.Array  # [D]
    w_gate_up: jax.Array  # [D, 2F]  columns: gate | up
    w_down: jax.Array  # [F, D]

    # Each array's dimensions by name, for the mesh placement (etjax/distributed/placement.py):
    # "heads" and "ffn" are what tensor parallelism splits (q|k|v and gate|up by output column,
    # the output and down projections by input row); unnamed dimensions are never split.
    AXES: ClassVar[dict[str, tuple[str | None, ...]]] = {
        "attn_norm": (None,),
        "wqkv": (None, "heads"),
        "bqkv": ("heads",),
        "wo": ("heads", None),
        "mlp_norm": (None,),
        "w_gate_up": (None, "ffn"),
        "w_down": ("ffn", None),
    }


@flax.struct.dataclass
class Weights:
    """All weights of a decoder. V = vocabulary."""

    embed: jax.Array  # [V, D]
    layers: tuple[LayerWeights, ...]
    final_norm: jax.Array  # [D]
    lm_head: jax.Array | None  # [D, V], or None when tied to `embed`

    # As `LayerWeights.AXES`; `layers` holds LayerWeights, which name their own.
    AXES: ClassVar[dict[str, tuple[str | None, ...]]] = {
        "embed": ("vocab", None),
        "final_norm": (None,),
        "lm_head": (None, "vocab"),
    }


def check_weights_shapes(weights: Weights, cfg: ModelConfig, source: str) -> None:
    """Raise ValueError naming `source` and the field if any weight has the wrong shape."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    a = cfg.num_heads * cfg.head_dim
    expected = {
        "embed": (cfg.vocab_size, d),
        "final_norm": (d,),
    }
    if weights.lm_head is not None:
        expected["lm_head"] = (d, cfg.vocab_size)
    for name, shape in expected.items():
        got = getattr(weights, name).shape
        if got != shape:
            raise ValueError(f"{source}: {name} has shape {got}, expected {shape} from the config")
    if len(weights.layers) != cfg.num_layers:
        raise ValueError(
            f"{source}: found {len(weights.layers)} layers, config says {cfg.num_layers}"
        )
    layer_expected = {
        "attn_norm": (d,),
        "wqkv": (d, cfg.qkv_size),
        "wo": (a, d),
        "mlp_norm": (d,),
        "w_gate_up": (d, 2 * f),
        "w_down": (f, d),
    }
    for i, layer in enumerate(weights.layers):
        for name, shape in layer_expected.items():
            got = getattr(layer, name).shape
            if got != shape:
                raise ValueError(
                    f"{source}: layer {i} {name} has shape {got}, expected {shape} from the config"
                )
