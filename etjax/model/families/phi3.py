"""Phi-3 (Phi-3-mini, Phi-3.5-mini, Phi-4-mini): Llama's layer, stored fused.

Its files hold q|k|v in one projection (`qkv_proj`, llama.cpp's `attn_qkv`) and gate|up in
another (`gate_up_proj`; llama.cpp's `ffn_up` holds both), in the row orders etjax's own fused
leaves have, so each loads as a single part, with no bias. Its sliding window (Phi-3-mini-4k:
2047 positions of a 4096 context) covers every layer, which rotates as usual
(`ModelConfig.local_layers`, etjax/loaders/hf_config.py). RoPE "longrope" (its 128k
variants) is read with its short factors, for contexts up to the original one
(etjax/model/config.py `RopeScaling`).
"""

from __future__ import annotations

import jax

from etjax.model.config import ModelConfig
from etjax.model.families import llama
from etjax.model.families.family import Family
from etjax.model.layers import linear, rms_norm
from etjax.model.leaves import ATTENTION, FFN, GATE_UP, HIDDEN, QKV, Leaf, layer_part, pytree_class

LAYER = {  # the leaves of one layer (a `Table`)
    "attn_norm": llama.norm_leaf("input_layernorm.weight", "attn_norm.weight"),
    # rows: q heads | k heads | v heads, as etjax fuses them (Hugging Face RoPE layout)
    "wqkv": Leaf((QKV, HIDDEN), (layer_part("self_attn.qkv_proj.weight", "attn_qkv.weight"),)),
    "wo": Leaf((HIDDEN, ATTENTION), (layer_part("self_attn.o_proj.weight", "attn_output.weight"),)),
    "mlp_norm": llama.norm_leaf("post_attention_layernorm.weight", "ffn_norm.weight"),
    # rows: gate | up (transformers' Phi3MLP splits them in this order)
    "w_gate_up": Leaf((GATE_UP, HIDDEN), (layer_part("mlp.gate_up_proj.weight", "ffn_up.weight"),)),
    "w_down": Leaf((HIDDEN, FFN), (layer_part("mlp.down_proj.weight", "ffn_down.weight"),)),
}


def qkv_projection(layer, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """x [T, D] -> q|k|v [T, Q]: RMSNorm, then the fused projection."""
    return linear(rms_norm(x, layer.attn_norm, cfg.rms_norm_eps), layer.wqkv)


Phi3Layer = pytree_class("Phi3Layer", LAYER, __name__)

PHI3 = Family(
    name="phi3",
    layer=LAYER,
    layer_type=Phi3Layer,
    qkv_projection=qkv_projection,
    output_and_mlp=llama.output_and_mlp,
    hf_model_types=("phi3",),
    gguf_architectures=("phi3",),
)
