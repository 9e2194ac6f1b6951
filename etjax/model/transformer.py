"""The Llama-family decoder as pure functions over `Weights` and a paged `KVCache`.

One forward pass serves every phase: prefill (many tokens per sequence starting at 0), chunked
prefill (a chunk continuing a cached prefix) and decode (one token per sequence). New keys and
values are written to their pages first, then the queries attend causally over the pages.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from etjax.cache.kv_cache import KVCache, write_kv
from etjax.model.config import ModelConfig
from etjax.model.layers import apply_rope, rms_norm, rope_inverse_frequencies, swiglu_mlp
from etjax.model.weights import LayerWeights, Weights
from pallas_kernels.paged_attention import paged_attention_xla


def forward(
    weights: Weights,
    cache: KVCache,
    tokens: jax.Array,
    positions: jax.Array,
    valid: jax.Array,
    page_table: jax.Array,
    cfg: ModelConfig,
) -> tuple[jax.Array, KVCache]:
    """Run the decoder over new tokens, appending their keys and values to the cache.

    Args:
      tokens: [B, S] int32 token ids.
      positions: [B, S] int32 absolute positions (a sequence's tokens are contiguous).
      valid: [B, S] bool; padding tokens are computed but neither cached nor meaningful.
      page_table: [B, P] int32 pages of each sequence (see `kv_cache`).

    Returns:
      hidden: [B, S, D] final-normed hidden states in the model dtype, and the updated cache.
    """
    inv_freq = rope_inverse_frequencies(cfg)
    x = weights.embed[tokens]
    new_k, new_v = [], []
    for layer, k_pages, v_pages in zip(weights.layers, cache.k, cache.v, strict=True):
        h = rms_norm(x, layer.attn_norm, cfg.rms_norm_eps)
        attn, k_pages, v_pages = _attention(
            h, layer, k_pages, v_pages, positions, valid, page_table, inv_freq, cfg
        )
        x = x + attn
        h = rms_norm(x, layer.mlp_norm, cfg.rms_norm_eps)
        x = x + swiglu_mlp(h, layer.w_gate_up, layer.w_down)
        new_k.append(k_pages)
        new_v.append(v_pages)
    hidden = rms_norm(x, weights.final_norm, cfg.rms_norm_eps)
    return hidden, KVCache(k=tuple(new_k), v=tuple(new_v))


def logits_from_hidden(weights: Weights, hidden: jax.Array) -> jax.Array:
    """Project hidden states [..., D] to float32 logits [..., V] (tied or untied head)."""
    if weights.lm_head is None:
        # Contract with the embedding's model axis directly: no transposed copy of the table.
        return jnp.einsum(
            "...d,vd->...v", hidden, weights.embed, preferred_element_type=jnp.float32
        )
    return jnp.einsum("...d,dv->...v", hidden, weights.lm_head, preferred_element_type=jnp.float32)


def _attention(
    h: jax.Array,
    layer: LayerWeights,
    k_pages: jax.Array,
    v_pages: jax.Array,
    positions: jax.Array,
    valid: jax.Array,
    page_table: jax.Array,
    inv_freq: jax.Array,
    cfg: ModelConfig,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    # h: [B, S, D] -> attention output [B, S, D] and the layer's updated pages.
    b, s, _ = h.shape
    hd = cfg.head_dim
    qkv = h @ layer.wqkv
    if layer.bqkv is not None:
        qkv = qkv + layer.bqkv
    q_width, kv_width = cfg.num_heads * hd, cfg.num_kv_heads * hd
    q = qkv[..., :q_width].reshape(b, s, cfg.num_heads, hd)
    k = qkv[..., q_width : q_width + kv_width].reshape(b, s, cfg.num_kv_heads, hd)
    v = qkv[..., q_width + kv_width :].reshape(b, s, cfg.num_kv_heads, hd)
    q = apply_rope(q, positions, inv_freq)
    k = apply_rope(k, positions, inv_freq)
    k_pages, v_pages = write_kv(k_pages, v_pages, k, v, page_table, positions, valid)
    out = paged_attention_xla(q, k_pages, v_pages, page_table, positions)
    return out.reshape(b, s, cfg.num_heads * hd) @ layer.wo, k_pages, v_pages
