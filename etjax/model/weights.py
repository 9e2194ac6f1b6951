"""The weights pytree of a Llama-family decoder.

The layers are one `LayerWeights` whose every leaf is stacked on a leading layer axis
`[L, ...]`: the model runs its layers as a `lax.scan` (etjax/model/transformer.py), so XLA
compiles one layer body instead of one per layer (SmolLM2's 30-layer forward pass compiled in
3.7 s unrolled and 0.8 s scanned on a 2-core CPU; a decode step ran 2-5% slower). Inside the
scan each step reads its layer's slice in place; outside it, a static slice `leaf[i]` is a
copy, which is fine for tests and loaders but never done per step.

Projections are stored input-major (`x @ w`) and fused where they share an input: q|k|v in one
matrix and gate|up in another, so each layer runs two large products instead of five small ones.
"""

from __future__ import annotations

import flax.struct
import jax


@flax.struct.dataclass
class LayerWeights:
    """The decoder layers, stacked. L = layers, D = hidden, F = intermediate, Q = qkv width,
    A = heads * head_dim."""

    attn_norm: jax.Array  # [L, D]
    wqkv: jax.Array  # [L, D, Q]  columns: q heads | k heads | v heads, half-split RoPE layout
    bqkv: jax.Array | None  # [L, Q] or None (only Qwen2-style attention_bias)
    wo: jax.Array  # [L, A, D]
    mlp_norm: jax.Array  # [L, D]
    w_gate_up: jax.Array  # [L, D, 2F]  columns: gate | up
    w_down: jax.Array  # [L, F, D]


@flax.struct.dataclass
class Weights:
    """All weights of a decoder. V = vocabulary."""

    embed: jax.Array  # [V, D]
    layers: LayerWeights
    final_norm: jax.Array  # [D]
    lm_head: jax.Array | None  # [D, V], or None when tied to `embed`


def layer_slice(weights: Weights, index: int) -> LayerWeights:
    """Layer `index`'s weights, unstacked (a copy: for tests and inspection, not a step)."""
    return jax.tree.map(lambda leaf: leaf[index], weights.layers)
