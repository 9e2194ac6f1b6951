"""One attention call per layer: `attend_layer`, and `check_plans`.

The model calls `attend_layer` once per layer, after writing the layer's new keys and values,
with the step's plan. Here alone is read how the layer's tokens attend: densely (the plan's
passes), through their window (a sliding-window layer: the plan's local passes), or, for
pruned decode rows, to the blocks their budgets keep (the plan's `sparse` part; in a ragged
step beside the plan's dense prompt chunks). Whether rows prune, and on which kernels, is the
plan's backend's (backend.py). `check_plans` refuses the plans no layer can run, before any
is traced.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from etjax.attention.plan import AttentionPlan
from etjax.attention.pruned import pruned_decode_attention
from etjax.attention.seam import attend
from etjax.cache.kv_cache import NULL_PAGE, PagePool


def check_plans(plan: AttentionPlan | None, window: int, softcap: float) -> None:
    """Raises ValueError, saying why, when a model whose local layers see `window` positions
    (0: none) and whose scores are capped at `softcap` (0: none) cannot attend with `plan`."""
    if plan is None:
        raise ValueError("forward needs an attention plan (etjax/attention/plan.py)")
    if plan.window != window:
        raise ValueError(
            f"an attention plan for a window of {plan.window} positions; the model's local "
            f"layers have {window} (plan_passes(window=cfg.attention_window))"
        )
    sparse = plan.sparse
    if sparse is None:
        return
    if not plan.backend.prunes:
        raise ValueError(
            f"pruned rows in a plan whose backend ({plan.backend.name}) does not prune: "
            "resolve_backend(..., pruning=PruningConfig(...).shape())"
        )
    if softcap:
        raise ValueError(
            "pruned attention does not soft-cap attention scores "
            f"(attn_logit_softcapping={softcap}, Gemma 2): decode without pruning"
        )
    if sparse.slots is not None and not plan.passes:
        raise ValueError("a ragged step's plan needs passes for the tokens that are not rows")


def attend_layer(
    q: jax.Array,
    pool: PagePool,
    first_page: jax.Array,
    positions: jax.Array,
    write_pages: jax.Array,
    plan: AttentionPlan,
    local: jax.Array | bool = False,
    softcap: float = 0.0,
) -> tuple[jax.Array, PagePool]:
    """One layer's attention: q [T, H, hd] (RoPE applied) over `pool`, which already holds the
    step's keys and values; first_page: the pool page of this layer's page 0; positions,
    write_pages [T] as the model's; local: a sliding-window layer (a traced flag); softcap:
    Gemma 2's cap on scores (dense attention only: `check_plans` refuses pruning with one).
    Returns the heads [T, H, hd] and the pool with the block mass pruning remembered."""
    if plan.sparse is None:
        return attend(q, pool.k, pool.v, positions, plan, first_page, local, softcap), pool
    pruned_layer = functools.partial(_pruned, q, pool, first_page, positions, write_pages, plan)
    if plan.window == 0:
        return pruned_layer()

    # A model with sliding-window layers: only its global layers prune; a local layer reads
    # every token's window through the plan's local passes (the block mass stays as it was).
    def windowed():
        return attend(q, pool.k, pool.v, positions, plan, first_page, True), pool.block_mass

    def pruned():
        heads, pruned_pool = pruned_layer()
        return heads, pruned_pool.block_mass

    heads, mass = jax.lax.cond(local, windowed, pruned)
    return heads, pool.replace(block_mass=mass)


def _pruned(q, pool, first_page, positions, write_pages, plan):
    # The rows' tokens (a verifying row's drafts each as a row: runtime/steps.py) read the
    # blocks their budgets keep; in a ragged step, the plan's tokens (chunks) attend densely.
    # Arguments as `attend_layer`'s; returns the heads [T, H, hd] and the pool.
    sparse, backend = plan.sparse, plan.backend
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
        backend.pruning,
        sparse.thresholds,
        sparse.max_kept,
        backend,
        mass_rows=rows + layer * pool.mass_rows_per_layer,
        groups=sparse.groups,
        fraction=sparse.fraction,
    )
    if slots is None:
        return heads, pool
    dense = attend(q, pool.k, pool.v, positions, plan, first_page)
    return dense.at[slots].set(heads, mode="drop"), pool
