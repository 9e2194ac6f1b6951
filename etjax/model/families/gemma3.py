"""Gemma 3 (text): Llama's attention with per-head q/k norms, norms after attention and the MLP
as well as before, a GeGLU MLP (tanh-approximated GELU), a scaled embedding, and sliding-window
layers (`ModelConfig.local_layers`, handled by the shared forward pass and the attention seam).

Gemma's RMSNorm scales by 1 + w. llama.cpp stores 1 + w in its GGUF files; the Hugging Face
tensors hold w, and `hf_offset` adds the 1 as they are read, so every norm here multiplies by
its stored scale, like Llama's. The norms here also multiply in float32 before casting back, as
Gemma's do (Llama's cast first).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from etjax.model.config import ModelConfig
from etjax.model.families.family import Family
from etjax.model.layers import linear, mean_square
from etjax.model.leaves import (
    ATTENTION,
    FFN,
    GATE_UP,
    HEAD_DIM,
    HIDDEN,
    QKV,
    STORED,
    VOCAB,
    Leaf,
    Part,
    Table,
    layer_part,
    pytree_class,
)


def _norm(hf: str, gguf: str, dim=HIDDEN) -> Leaf:
    return Leaf((dim,), (layer_part(hf, gguf, hf_offset=1.0),), STORED, float32=True)


LAYER: Table = {
    "attn_norm": _norm("input_layernorm.weight", "attn_norm.weight"),
    "wqkv": Leaf(  # rows: q heads | k heads | v heads (llama.cpp keeps Gemma's row order)
        (QKV, HIDDEN),
        (
            layer_part("self_attn.q_proj.weight", "attn_q.weight"),
            layer_part("self_attn.k_proj.weight", "attn_k.weight"),
            layer_part("self_attn.v_proj.weight", "attn_v.weight"),
        ),
    ),
    "q_norm": _norm("self_attn.q_norm.weight", "attn_q_norm.weight", HEAD_DIM),
    "k_norm": _norm("self_attn.k_norm.weight", "attn_k_norm.weight", HEAD_DIM),
    "wo": Leaf((HIDDEN, ATTENTION), (layer_part("self_attn.o_proj.weight", "attn_output.weight"),)),
    "post_attn_norm": _norm("post_attention_layernorm.weight", "post_attention_norm.weight"),
    "mlp_norm": _norm("pre_feedforward_layernorm.weight", "ffn_norm.weight"),
    "w_gate_up": Leaf(  # rows: gate | up
        (GATE_UP, HIDDEN),
        (
            layer_part("mlp.gate_proj.weight", "ffn_gate.weight"),
            layer_part("mlp.up_proj.weight", "ffn_up.weight"),
        ),
    ),
    "w_down": Leaf((HIDDEN, FFN), (layer_part("mlp.down_proj.weight", "ffn_down.weight"),)),
    "post_mlp_norm": _norm("post_feedforward_layernorm.weight", "post_ffw_norm.weight"),
}

# The embedding is always tied to the head; the final norm scales by 1 + w like the others.
MODEL: Table = {
    "embed": Leaf(
        (VOCAB, HIDDEN), (Part("model.embed_tokens.weight", "token_embd.weight"),), STORED
    ),
    "final_norm": Leaf(
        (HIDDEN,),
        (Part("model.norm.weight", "output_norm.weight", hf_offset=1.0),),
        STORED,
        float32=True,
    ),
    "lm_head": Leaf(
        (VOCAB, HIDDEN),
        (Part("lm_head.weight", "output.weight"),),
        present=lambda cfg: not cfg.tie_word_embeddings,
    ),
}


def gemma_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, normalised and scaled in float32, then cast to x's dtype."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(mean_square(x32) + eps)
    return (normed * scale).astype(x.dtype)


def qkv_projection(layer, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """x [T, D] -> q|k|v [T, Q]: RMSNorm, the fused projection, then each query and key head
    normed (before RoPE). Queries are rescaled so that the kernels' head_dim ** -0.5 comes to
    query_pre_attn_scalar ** -0.5 (RoPE is linear, so scaling before it is the same)."""
    t, hd = x.shape[0], cfg.head_dim
    qkv = linear(gemma_norm(x, layer.attn_norm, cfg.rms_norm_eps), layer.wqkv)
    q_width, kv_width = cfg.num_heads * hd, cfg.num_kv_heads * hd
    q = gemma_norm(qkv[:, :q_width].reshape(t, cfg.num_heads, hd), layer.q_norm, cfg.rms_norm_eps)
    k = qkv[:, q_width : q_width + kv_width].reshape(t, cfg.num_kv_heads, hd)
    k = gemma_norm(k, layer.k_norm, cfg.rms_norm_eps)
    if cfg.query_pre_attn_scalar and cfg.query_pre_attn_scalar != hd:
        q = (q * (hd / cfg.query_pre_attn_scalar) ** 0.5).astype(q.dtype)
    return jnp.concatenate(
        [q.reshape(t, q_width), k.reshape(t, kv_width), qkv[:, q_width + kv_width :]], axis=-1
    )


def output_and_mlp(layer, x: jax.Array, heads: jax.Array, cfg: ModelConfig) -> jax.Array:
    """x [T, D], heads [T, A] -> x [T, D]: the attention output normed into the residual, then
    the GeGLU MLP between its pre- and post-norms."""
    eps = cfg.rms_norm_eps
    x = x + gemma_norm(linear(heads, layer.wo), layer.post_attn_norm, eps)
    h = gemma_norm(x, layer.mlp_norm, eps)
    gate, up = jnp.split(linear(h, layer.w_gate_up), 2, axis=-1)
    mlp = linear(jax.nn.gelu(gate, approximate=True) * up, layer.w_down)
    return x + gemma_norm(mlp, layer.post_mlp_norm, eps)


Gemma3Layer = pytree_class("Gemma3Layer", LAYER, __name__)

GEMMA3 = Family(
    name="gemma3",
    layer=LAYER,
    layer_type=Gemma3Layer,
    qkv_projection=qkv_projection,
    output_and_mlp=output_and_mlp,
    hf_model_types=("gemma3_text",),
    gguf_architectures=("gemma3",),
    model=MODEL,
    scales_embedding=True,
    local_rope=True,
)
