"""The decoder as pure functions over `Weights` and a paged `KVCache`.

One forward pass serves every phase over a flat batch of tokens: prefill (many tokens per
sequence starting at 0), chunked prefill (a chunk continuing a cached prefix) and decode (one
token per sequence), mixed freely. New keys and values are written to their pages first, then
the queries attend causally over their own sequence's pages (etjax/attention).

The layers run as a `lax.scan` over layer indices with the cache as one pool of pages
(etjax/cache/kv_cache.py), so XLA compiles the costly part of a layer (the cache writes and the
attention loops) once, not once per layer: SmolLM2's 30-layer forward pass compiled in 3.7 s
unrolled and 0.9 s this way on a 2-core CPU. The layer's matrix products run in a `lax.switch`
over the per-layer weights: each branch reads its layer's own buffers, where indexing weights
stacked on a layer axis made XLA:CPU copy every layer's weights before its products (a decode
step then ran ~1.8x slower in isolation). Branches of plain products compile in milliseconds.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from etjax.attention import AttentionPlan, attend_layer, check_plans
from etjax.cache.kv_cache import KVCache, cache_from_pool, page_pool, write_kv
from etjax.model.config import ModelConfig
from etjax.model.families import family
from etjax.model.layers import rms_norm
from etjax.model.products import project
from etjax.model.quantized import embedding_rows
from etjax.model.rope import apply_rope, rope_attention_factor, rope_inverse_frequencies
from etjax.model.weights import Weights


def forward(
    weights: Weights,
    cache: KVCache,
    tokens: jax.Array,
    positions: jax.Array,
    write_pages: jax.Array,
    cfg: ModelConfig,
    plan: AttentionPlan | None = None,
    active_k: jax.Array | None = None,
) -> tuple[jax.Array, KVCache]:
    """Run the decoder over a flat batch of new tokens, appending their keys and values.

    Args:
      tokens: [T] int32 token ids of any number of sequences (prefill chunks, decode tokens).
      positions: [T] int32 absolute positions.
      write_pages: [T] int32 the page each token's key and value go to; the null page for
        padding tokens, which are computed but neither cached nor meaningful.
      plan: what each token attends to (etjax/attention/plan.py); required. Its `sparse`
        part, under pruning, holds decode tokens (one per row of `sparse.page_table`, at the
        flat indices `sparse.slots`, or every token when that is None) that attend per layer
        only to the blocks the budget keeps, chosen by query-aware key bounds (etjax/pruning);
        the plan's passes hold the other tokens (a ragged step's chunks), which attend
        densely, and list no items for the rows. Pruning applies to global layers only: a
        sliding-window layer already reads at most its window, and reads it whole, the rows'
        tokens included (the plan's local passes list them).
      active_k: [T] int32 in 1..num_experts_per_tok, the routed experts each token runs in
        every sparse layer (entropy-steered experts, etjax/experts); None: all k. A model
        without routed experts refuses it.

    Returns:
      hidden: [T, D] final-normed hidden states in the model dtype, and the updated cache.
    """
    check_plans(plan, cfg.attention_window, cfg.attn_logit_softcapping)
    if active_k is not None and not cfg.num_experts:
        raise ValueError(f"active_k given for a model without routed experts ({cfg.architecture})")
    # What a layer computes around attention is its family's (etjax/model/families/).
    fam = family(cfg.architecture)
    # A quantized table dequantizes the tokens' rows only; a float one in another dtype than
    # the activations' (weights="bfloat16" with float32 activations) is cast.
    x = embedding_rows(weights.embed, tokens, cfg.jnp_dtype)
    if fam.scales_embedding:
        x = x * jnp.asarray(cfg.hidden_size**0.5, x.dtype)

    t, hd = tokens.shape[0], cfg.head_dim
    q_width, kv_width = cfg.num_heads * hd, cfg.num_kv_heads * hd
    # Local (sliding-window) layers rotate with their own base where the family says so
    # (Gemma 3); a traced flag per layer.
    inv_freq = rope_inverse_frequencies(cfg)
    local_inv_freq = rope_inverse_frequencies(
        dataclasses.replace(cfg, rope_theta=cfg.rope_local_theta, rope_scaling=None)
    )
    own_local_rope = bool(cfg.local_layers) and fam.local_rope
    rope_scale = rope_attention_factor(cfg)  # 1 for a Gemma 3 local layer, unscaled
    is_local = jnp.asarray([i in cfg.local_layers for i in range(cfg.num_layers)])

    per_layer_qkv = [
        functools.partial(fam.qkv_projection, layer, cfg=cfg) for layer in weights.layers
    ]
    # Only families with routed experts take active_k (and only when it is given, so the
    # programs without it are the ones they always were).
    routing = {} if active_k is None else {"active_k": active_k}
    per_layer_rest = [
        functools.partial(fam.output_and_mlp, layer, cfg=cfg, **routing) for layer in weights.layers
    ]

    def layer_step(carry, index):
        x, pool = carry
        qkv = jax.lax.switch(index, per_layer_qkv, x)
        local = is_local[index]
        freq, scale = inv_freq, rope_scale
        if own_local_rope:
            freq = jnp.where(local, local_inv_freq, inv_freq)
            scale = scale if scale == 1.0 else jnp.where(local, 1.0, scale)
        q = apply_rope(qkv[:, :q_width].reshape(t, cfg.num_heads, hd), positions, freq, scale)
        k = apply_rope(
            qkv[:, q_width : q_width + kv_width].reshape(t, cfg.num_kv_heads, hd),
            positions,
            freq,
            scale,
        )
        v = qkv[:, q_width + kv_width :].reshape(t, cfg.num_kv_heads, hd)
        first_page = index * pool.pages_per_layer
        pool = write_kv(pool, k, v, write_pages, positions, first_page)
        # The layer's one attention call: dense, windowed or pruned is decided there.
        heads, pool = attend_layer(
            q,
            pool,
            first_page,
            positions,
            write_pages,
            plan,
            local,
            cfg.attn_logit_softcapping,
        )
        x = jax.lax.switch(index, per_layer_rest, x, heads.reshape(t, q_width))
        return (x, pool), None

    layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
    (x, pool), _ = jax.lax.scan(layer_step, (x, page_pool(cache)), layer_ids)
    hidden = rms_norm(x, weights.final_norm, cfg.rms_norm_eps)
    return hidden, cache_from_pool(pool)


def logits_from_hidden(weights: Weights, hidden: jax.Array) -> jax.Array:
    """Project hidden states [..., D] to float32 logits [..., V] (tied or untied head, both
    [V, D]), soft-capped where the model caps them (`Weights.logit_softcap`, Gemma 2)."""
    table = weights.embed if weights.lm_head is None else weights.lm_head
    logits = project(hidden, table, jnp.float32)
    cap = weights.logit_softcap
    return logits if not cap else cap * jnp.tanh(logits / cap)
