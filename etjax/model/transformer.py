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

import flax.struct
import jax
import jax.numpy as jnp

from etjax.attention import XLA, AttentionBackend, AttentionPlan, attend, pruned_decode_attention
from etjax.cache.kv_cache import NULL_PAGE, KVCache, PagePool, cache_from_pool, page_pool, write_kv
from etjax.model.config import ModelConfig
from etjax.model.families import family
from etjax.model.layers import rms_norm
from etjax.model.products import project
from etjax.model.rope import apply_rope, rope_attention_factor, rope_inverse_frequencies
from etjax.model.weights import Weights
from etjax.pruning.config import PruningShape, PruningThresholds
from etjax.pruning.groups import PrunedGroups


def forward(
    weights: Weights,
    cache: KVCache,
    tokens: jax.Array,
    positions: jax.Array,
    write_pages: jax.Array,
    cfg: ModelConfig,
    plan: AttentionPlan | None = None,
    sparse: SparsePlan | None = None,
    active_k: jax.Array | None = None,
) -> tuple[jax.Array, KVCache]:
    """Run the decoder over a flat batch of new tokens, appending their keys and values.

    Args:
      tokens: [T] int32 token ids of any number of sequences (prefill chunks, decode tokens).
      positions: [T] int32 absolute positions.
      write_pages: [T] int32 the page each token's key and value go to; the null page for
        padding tokens, which are computed but neither cached nor meaningful.
      plan: what each token attends to (etjax/attention/plan.py), for dense attention.
      sparse: for decode tokens (one per row of `sparse.page_table`, at the flat indices
        `sparse.slots`, or every token when that is None): attend per layer only to the blocks
        the budget keeps, chosen by query-aware key bounds (etjax/pruning). With a plan too
        (a ragged step under pruning), the plan's tokens attend densely and the rows' tokens
        take the pruned path; the plan lists no items for them. Pruning applies to global
        layers only: a sliding-window layer already reads at most its window, and reads it
        whole, the rows' tokens included (the plan's local passes list them).
      active_k: [T] int32 in 1..num_experts_per_tok, the routed experts each token runs in
        every sparse layer (entropy-steered experts, etjax/experts); None: all k. A model
        without routed experts refuses it.

    Returns:
      hidden: [T, D] final-normed hidden states in the model dtype, and the updated cache.
    """
    if plan is None and (sparse is None or sparse.slots is not None):
        raise ValueError("forward needs an attention plan for tokens that are not pruned rows")
    if plan is not None and plan.window != cfg.attention_window:
        raise ValueError(
            f"an attention plan for a window of {plan.window} positions; the model's local "
            f"layers have {cfg.attention_window} (plan_passes(window=cfg.attention_window))"
        )
    if sparse is not None and cfg.attn_logit_softcapping:
        raise ValueError(
            "pruned attention does not soft-cap attention scores "
            f"(attn_logit_softcapping={cfg.attn_logit_softcapping}, Gemma 2): decode without "
            "pruning"
        )
    if sparse is not None and cfg.local_layers and plan is None:
        raise ValueError(
            "pruned attention on a model with sliding-window layers needs a plan: its local "
            "layers read each row's window densely (plan_passes(local_groups=...))"
        )
    if active_k is not None and not cfg.num_experts:
        raise ValueError(f"active_k given for a model without routed experts ({cfg.architecture})")
    # What a layer computes around attention is its family's (etjax/model/families/).
    fam = family(cfg.architecture)
    x = weights.embed[tokens]
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
        heads, pool = _attention(
            q,
            k,
            v,
            pool,
            first_page,
            positions,
            write_pages,
            plan,
            sparse,
            local,
            cfg.attn_logit_softcapping,
        )
        x = jax.lax.switch(index, per_layer_rest, x, heads.reshape(t, q_width))
        return (x, pool), None

    layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
    (x, pool), _ = jax.lax.scan(layer_step, (x, page_pool(cache)), layer_ids)
    hidden = rms_norm(x, weights.final_norm, cfg.rms_norm_eps)
    return hidden, cache_from_pool(pool)


@flax.struct.dataclass
class SparsePlan:
    """How a decode step prunes attention: per-row block budgets, the static settings and the
    traced thresholds."""

    budget_blocks: jax.Array  # [B] int32 blocks each row may read (all layers and KV heads)
    page_table: jax.Array  # [B, P] int32 pages of each row's sequence
    thresholds: PruningThresholds
    pruning: PruningShape = flax.struct.field(pytree_node=False)
    max_kept: int = flax.struct.field(pytree_node=False)  # static width of the kept table
    backend: AttentionBackend = flax.struct.field(pytree_node=False, default=XLA)
    # [B] int32 flat index of each row's token in a ragged step (out of range for padding
    # rows); None: the step's tokens are exactly the rows'.
    slots: jax.Array | None = None
    # [B] int32 each row's row of the cache's block mass (the engine's store rows); None: row
    # b is row b.
    rows: jax.Array | None = None
    # [B] float32 the kept fraction the budgets come from, for a row whose tokens reach past
    # its first token's page (a verifying row's drafts: runtime/steps.py `_per_token`).
    fraction: jax.Array | None = None
    # Rows sharing a prefix that select and read it together (etjax/pruning/groups.py);
    # None: each row alone. Only for a step whose tokens are exactly the rows'.
    groups: PrunedGroups | None = None


def logits_from_hidden(weights: Weights, hidden: jax.Array) -> jax.Array:
    """Project hidden states [..., D] to float32 logits [..., V] (tied or untied head, both
    [V, D]), soft-capped where the model caps them (`Weights.logit_softcap`, Gemma 2)."""
    table = weights.embed if weights.lm_head is None else weights.lm_head
    logits = project(hidden, table, jnp.float32)
    cap = weights.logit_softcap
    return logits if not cap else cap * jnp.tanh(logits / cap)


def _attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    pool: PagePool,
    first_page: jax.Array,
    positions: jax.Array,
    write_pages: jax.Array,
    plan: AttentionPlan | None,
    sparse: SparsePlan | None,
    local: jax.Array | bool = False,
    softcap: float = 0.0,
) -> tuple[jax.Array, PagePool]:
    # q: [T, H, hd], k, v: [T, KVH, hd] (RoPE applied) -> attention heads [T, H, hd] and the
    # pool with this layer's pages updated; first_page: the pool page of this layer's page 0;
    # local: a sliding-window layer (the plan's local passes); softcap: Gemma 2's cap on
    # scores (dense attention only: forward refuses pruning with one).
    pool = write_kv(pool, k, v, write_pages, positions, first_page)
    if sparse is None:
        return attend(q, pool.k, pool.v, positions, plan, first_page, local, softcap), pool
    if plan is None or plan.window == 0:
        return _pruned_attention(q, pool, first_page, positions, write_pages, plan, sparse)

    # A model with sliding-window layers: only its global layers prune; a local layer reads
    # every token's window through the plan's local passes (the block mass stays as it was).
    def windowed():
        return attend(q, pool.k, pool.v, positions, plan, first_page, True), pool.block_mass

    def pruned():
        heads, pruned_pool = _pruned_attention(
            q, pool, first_page, positions, write_pages, plan, sparse
        )
        return heads, pruned_pool.block_mass

    heads, mass = jax.lax.cond(local, windowed, pruned)
    return heads, pool.replace(block_mass=mass)


def _pruned_attention(
    q: jax.Array,
    pool: PagePool,
    first_page: jax.Array,
    positions: jax.Array,
    write_pages: jax.Array,
    plan: AttentionPlan | None,
    sparse: SparsePlan,
) -> tuple[jax.Array, PagePool]:
    # The rows' tokens (a verifying row's drafts each as a row: runtime/steps.py) read the
    # blocks their budgets keep; in a ragged step, the plan's tokens (chunks) attend densely.
    slots = sparse.slots

    def rows_of(x):  # the rows' entries of a flat array (zeros for padding rows)
        return x if slots is None else x.at[slots].get(mode="fill", fill_value=0)

    rows = sparse.rows
    if rows is None:
        rows = jnp.arange(sparse.page_table.shape[0], dtype=jnp.int32)
    layer = first_page // pool.pages_per_layer
    heads, pool = pruned_decode_attention(
        rows_of(q),
        pool,
        rows_of(positions),
        rows_of(write_pages) != NULL_PAGE,
        sparse.page_table + first_page,
        sparse.budget_blocks,
        sparse.pruning,
        sparse.thresholds,
        sparse.max_kept,
        sparse.backend,
        mass_rows=rows + layer * pool.mass_rows_per_layer,
        groups=sparse.groups,
        fraction=sparse.fraction,
    )
    if slots is None:
        return heads, pool
    dense = attend(q, pool.k, pool.v, positions, plan, first_page)
    return dense.at[slots].set(heads, mode="drop"), pool
