"""Llama (Llama 2/3, SmolLM, Mistral): pre-norm attention and SwiGLU MLP, RMSNorm.

Also the layer of Qwen2 (families/qwen2.py), which always has q/k/v biases and whose GGUF
files keep the q and k rows in Hugging Face order.
"""

from __future__ import annotations

import jax

from etjax.model.config import ModelConfig
from etjax.model.families.family import Family
from etjax.model.layers import linear, rms_norm, swiglu_mlp
from etjax.model.leaves import (
    ATTENTION,
    FFN,
    GATE_UP,
    HIDDEN,
    QKV,
    STORED,
    Leaf,
    Table,
    layer_part,
    pytree_class,
)


def has_attention_bias(cfg: ModelConfig) -> bool:
    return cfg.attention_bias


def norm_leaf(hf: str, gguf: str) -> Leaf:
    """A layer's RMSNorm weight [D] under its Hugging Face and GGUF names, kept in float32."""
    return Leaf((HIDDEN,), (layer_part(hf, gguf),), STORED, float32=True)


def layer_table(gguf_interleaved_rope: bool) -> Table:
    """The leaves of one layer. `gguf_interleaved_rope`: the family's GGUF files store the q and
    k rows in llama.cpp's per-head interleaved order (llama.cpp's converter permutes them for
    the `llama` architecture only)."""
    q_heads, kv_heads = ("num_heads", "num_kv_heads") if gguf_interleaved_rope else (None, None)
    return {
        "attn_norm": norm_leaf("input_layernorm.weight", "attn_norm.weight"),
        "wqkv": Leaf(  # rows: q heads | k heads | v heads, Hugging Face (half-split) RoPE
            (QKV, HIDDEN),
            (
                layer_part("self_attn.q_proj.weight", "attn_q.weight", q_heads),
                layer_part("self_attn.k_proj.weight", "attn_k.weight", kv_heads),
                layer_part("self_attn.v_proj.weight", "attn_v.weight"),
            ),
        ),
        "bqkv": Leaf(
            (QKV,),
            (
                layer_part("self_attn.q_proj.bias", "attn_q.bias"),
                layer_part("self_attn.k_proj.bias", "attn_k.bias"),
                layer_part("self_attn.v_proj.bias", "attn_v.bias"),
            ),
            present=has_attention_bias,
        ),
        "wo": Leaf(
            (HIDDEN, ATTENTION), (layer_part("self_attn.o_proj.weight", "attn_output.weight"),)
        ),
        "mlp_norm": norm_leaf("post_attention_layernorm.weight", "ffn_norm.weight"),
        "w_gate_up": Leaf(  # rows: gate | up
            (GATE_UP, HIDDEN),
            (
                layer_part("mlp.gate_proj.weight", "ffn_gate.weight"),
                layer_part("mlp.up_proj.weight", "ffn_up.weight"),
            ),
        ),
        "w_down": Leaf((HIDDEN, FFN), (layer_part("mlp.down_proj.weight", "ffn_down.weight"),)),
    }


def qkv_projection(layer, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """x [T, D] -> q|k|v [T, Q]: RMSNorm, then the fused projection (and bias)."""
    qkv = linear(rms_norm(x, layer.attn_norm, cfg.rms_norm_eps), layer.wqkv)
    return qkv if layer.bqkv is None else qkv + layer.bqkv


def output_and_mlp(layer, x: jax.Array, heads: jax.Array, cfg: ModelConfig) -> jax.Array:
    """x [T, D], heads [T, A] -> x [T, D]: add the attention output, then the SwiGLU MLP of
    the normed stream."""
    x = x + linear(heads, layer.wo)
    h = rms_norm(x, layer.mlp_norm, cfg.rms_norm_eps)
    return x + swiglu_mlp(h, layer.w_gate_up, layer.w_down)


LAYER = layer_table(gguf_interleaved_rope=True)
LlamaLayer = pytree_class("LlamaLayer", LAYER, __name__)

LLAMA = Family(
    name="llama",
    layer=LAYER,
    layer_type=LlamaLayer,
    qkv_projection=qkv_projection,
    output_and_mlp=output_and_mlp,
    # Mistral is Llama's layer; its sliding window caps the context (etjax/loaders/hf_config.py)
    # and llama.cpp writes its GGUF files as `llama`.
    hf_model_types=("llama", "mistral"),
    gguf_architectures=("llama",),
)
