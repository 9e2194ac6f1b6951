"""Mixtral (Mixtral-8x7B, 8x22B): Llama's attention (no biases) and, in every layer, routed
experts in place of the dense MLP (etjax/model/experts.py): 8 experts, the top 2 of each
token run, weighted by a softmax over their two router logits (the softmax over all 8,
renormalised over the two: `ModelConfig.norm_topk_prob`). A sliding window, where its config
has one, covers every layer (etjax/loaders/hf_config.py).

llama.cpp writes Mixtral as `llama` with `llama.expert_count` experts, the q and k rows
interleaved per head as Llama's, and each layer's experts stacked in one tensor per
projection, `[E, out, in]` (files written before April 2024: one tensor per expert,
`blk.{i}.ffn_gate.{e}.weight`; etjax/loaders/gguf_weights.py reads both).
"""

from __future__ import annotations

import jax

from etjax.model.config import ModelConfig
from etjax.model.families import llama
from etjax.model.families.family import Family
from etjax.model.families.qwen3_moe import expert_leaves, moe_output_and_mlp
from etjax.model.layers import linear, rms_norm
from etjax.model.leaves import Table, pytree_class

LAYER: Table = {
    **{
        name: leaf
        for name, leaf in llama.layer_table(gguf_interleaved_rope=True).items()
        if name not in ("bqkv", "w_gate_up", "w_down")
    },
    **expert_leaves(
        "block_sparse_moe.gate.weight",
        "block_sparse_moe.experts.{e}.w1.weight",  # gate
        "block_sparse_moe.experts.{e}.w3.weight",  # up
        "block_sparse_moe.experts.{e}.w2.weight",  # down
    ),
}


def qkv_projection(layer, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """x [T, D] -> q|k|v [T, Q]: RMSNorm, then the fused projection."""
    return linear(rms_norm(x, layer.attn_norm, cfg.rms_norm_eps), layer.wqkv)


MixtralLayer = pytree_class("MixtralLayer", LAYER, __name__)

MIXTRAL = Family(
    name="mixtral",
    layer=LAYER,
    layer_type=MixtralLayer,
    qkv_projection=qkv_projection,
    output_and_mlp=moe_output_and_mlp,
    hf_model_types=("mixtral",),
    gguf_architectures=("llama",),  # with `llama.expert_count` > 0
)
