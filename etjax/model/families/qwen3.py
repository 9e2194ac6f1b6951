"""Qwen3 (dense): Llama's layer without biases, with each query and key head RMS-normed (over
head_dim, before RoPE) by its own learned scale, shared across heads.

Its norms are Llama's (normalise in float32, cast, then scale), and its GGUF files, like
Qwen2's, keep the q and k rows in Hugging Face order. Sliding-window layers, which its configs
can ask for (`use_sliding_window`), rotate like the others (`Family.local_rope`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from etjax.model.config import ModelConfig
from etjax.model.families import llama
from etjax.model.families.family import Family
from etjax.model.layers import linear, rms_norm
from etjax.model.leaves import HEAD_DIM, STORED, Leaf, Table, layer_part, pytree_class


def _head_norm(hf: str, gguf: str) -> Leaf:
    return Leaf((HEAD_DIM,), (layer_part(hf, gguf),), STORED, float32=True)


def _layer_table() -> Table:
    # Llama's leaves less the q/k/v bias, with the two head norms after the fused projection.
    base = {name: leaf for name, leaf in llama.layer_table(False).items() if name != "bqkv"}
    table = {}
    for name, leaf in base.items():
        table[name] = leaf
        if name == "wqkv":
            table["q_norm"] = _head_norm("self_attn.q_norm.weight", "attn_q_norm.weight")
            table["k_norm"] = _head_norm("self_attn.k_norm.weight", "attn_k_norm.weight")
    return table


def qkv_projection(layer, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """x [T, D] -> q|k|v [T, Q]: RMSNorm, the fused projection, then every query and key head
    normed over head_dim (RoPE comes after, in the shared forward pass)."""
    t, hd, eps = x.shape[0], cfg.head_dim, cfg.rms_norm_eps
    qkv = linear(rms_norm(x, layer.attn_norm, eps), layer.wqkv)
    q_width, kv_width = cfg.num_heads * hd, cfg.num_kv_heads * hd
    q = rms_norm(qkv[:, :q_width].reshape(t, cfg.num_heads, hd), layer.q_norm, eps)
    k = rms_norm(
        qkv[:, q_width : q_width + kv_width].reshape(t, cfg.num_kv_heads, hd), layer.k_norm, eps
    )
    return jnp.concatenate(
        [q.reshape(t, q_width), k.reshape(t, kv_width), qkv[:, q_width + kv_width :]], axis=-1
    )


LAYER = _layer_table()
Qwen3Layer = pytree_class("Qwen3Layer", LAYER, __name__)

QWEN3 = Family(
    name="qwen3",
    layer=LAYER,
    layer_type=Qwen3Layer,
    qkv_projection=qkv_projection,
    output_and_mlp=llama.output_and_mlp,
    hf_model_types=("qwen3",),
    gguf_architectures=("qwen3",),
)
