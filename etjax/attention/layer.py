"""One attention call per layer: `attend_layer`, and the pruned rows' part of a step's plans,
`SparsePlan`.

The model calls `attend_layer` once per layer, after writing the layer's new keys and values,
with the step's plans. Here alone is decided how the layer's tokens attend: densely (the
plan's passes), through their window (a sliding-window layer: the plan's local passes), or,
for pruned decode rows, to the blocks their budgets keep (`SparsePlan`; in a ragged step beside
the plan's dense prompt chunks). The kernels are the backend's (backend.py) that both plans
carry. `check_plans` refuses the combinations no layer can run, before any is traced.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from etjax.attention.backend import XLA, AttentionBackend
from etjax.attention.plan import AttentionPlan
from etjax.attention.pruned import pruned_decode_attention
from etjax.attention.seam import attend
from etjax.cache.kv_cache import NULL_PAGE, PagePool
from etjax.pruning.config import PruningShape, PruningThresholds
from etjax.pruning.groups import PrunedGroups


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


def check_plans(
    plan: AttentionPlan | None,
    sparse: SparsePlan | None,
    window: int,
    softcap: float,
    local_layers: bool,
) -> None:
    """Raises ValueError, saying why, when a model whose local layers see `window` positions
    (0: none), whose scores are capped at `softcap` (0: none) and which has sliding-window
    layers (`local_layers`) cannot attend with these plans."""
    if plan is None and (sparse is None or sparse.slots is not None):
        raise ValueError("forward needs an attention plan for tokens that are not pruned rows")
    if plan is not None and plan.window != window:
        raise ValueError(
            f"an attention plan for a window of {plan.window} positions; the model's local "
            f"layers have {window} (plan_passes(window=cfg.attention_window))"
        )
    if sparse is not None and softcap:
        raise ValueError(
            "pruned attention does not soft-cap attention scores "
            f"(attn_logit_softcapping={softcap}, Gemma 2): decode without pruning"
        )
    if sparse is not None and local_layers and plan is None:
        raise ValueError(
            "pruned attention on a model with sliding-window layers needs a plan: its local "
            "layers read each row's window densely (plan_passes(local_groups=...))"
        )


def attend_layer(
    q: jax.Array,
    pool: PagePool,
    first_page: jax.Array,
    positions: jax.Array,
    write_pages: jax.Array,
    plan: AttentionPlan | None,
    sparse: SparsePlan | None,
    local: jax.Array | bool = False,
    softcap: float = 0.0,
) -> tuple[jax.Array, PagePool]:
    """One layer's attention: q [T, H, hd] (RoPE applied) over `pool`, which already holds the
    step's keys and values; first_page: the pool page of this layer's page 0; positions,
    write_pages [T] as the model's; local: a sliding-window layer (a traced flag); softcap:
    Gemma 2's cap on scores (dense attention only: `check_plans` refuses pruning with one).
    Returns the heads [T, H, hd] and the pool with the block mass pruning remembered."""
    if sparse is None:
        return attend(q, pool.k, pool.v, positions, plan, first_page, local, softcap), pool
    if plan is None or plan.window == 0:
        return _pruned(q, pool, first_page, positions, write_pages, plan, sparse)

    # A model with sliding-window layers: only its global layers prune; a local layer reads
    # every token's window through the plan's local passes (the block mass stays as it was).
    def windowed():
        return attend(q, pool.k, pool.v, positions, plan, first_page, True), pool.block_mass

    def pruned():
        heads, pruned_pool = _pruned(q, pool, first_page, positions, write_pages, plan, sparse)
        return heads, pruned_pool.block_mass

    heads, mass = jax.lax.cond(local, windowed, pruned)
    return heads, pool.replace(block_mass=mass)


def _pruned(
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
