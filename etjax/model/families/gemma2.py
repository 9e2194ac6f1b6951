"""Gemma 2: Gemma 3's layer without its q/k head norms (norms before and after attention and
the MLP, GeGLU, a scaled embedding, norms that scale by 1 + w, stored as the scale itself),
with soft caps on attention scores and on the final logits (`ModelConfig`'s
`attn_logit_softcapping` and `final_logit_softcapping`, applied by the attention kernels and
`logits_from_hidden`), and a sliding window on every other layer, which rotates with the
same base as the others.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from etjax.model.config import ModelConfig
from etjax.model.families import gemma3
from etjax.model.families.family import Family
from etjax.model.layers import linear
from etjax.model.leaves import Table, pytree_class

LAYER: Table = {
    name: leaf for name, leaf in gemma3.LAYER.items() if name not in ("q_norm", "k_norm")
}


def qkv_projection(layer, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """x [T, D] -> q|k|v [T, Q]: RMSNorm and the fused projection, queries rescaled so that
    the kernels' head_dim ** -0.5 comes to query_pre_attn_scalar ** -0.5 (as in Gemma 3)."""
    hd = cfg.head_dim
    qkv = linear(gemma3.gemma_norm(x, layer.attn_norm, cfg.rms_norm_eps), layer.wqkv)
    if not cfg.query_pre_attn_scalar or cfg.query_pre_attn_scalar == hd:
        return qkv
    q_width = cfg.num_heads * hd
    q = (qkv[:, :q_width] * (hd / cfg.query_pre_attn_scalar) ** 0.5).astype(qkv.dtype)
    return jnp.concatenate([q, qkv[:, q_width:]], axis=-1)


Gemma2Layer = pytree_class("Gemma2Layer", LAYER, __name__)

GEMMA2 = Family(
    name="gemma2",
    layer=LAYER,
    layer_type=Gemma2Layer,
    qkv_projection=qkv_projection,
    output_and_mlp=gemma3.output_and_mlp,
    hf_model_types=("gemma2",),
    gguf_architectures=("gemma2",),
    model=gemma3.MODEL,
    scales_embedding=True,
)
