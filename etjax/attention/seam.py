"""`attend`: dense attention of a step's tokens over the paged cache, as its plan describes.

The one call the model makes for dense attention. Today every platform runs the XLA backend
(pallas_kernels/ragged_attention/xla.py); the plan's layout is the one JAX's TPU ragged paged
attention kernel also takes apart (per-sequence query offsets, KV lengths and page lists), so a
kernel backend slots in here without the model or the engine changing.
"""

from __future__ import annotations

import jax

from etjax.attention.plan import AttentionPlan
from pallas_kernels.ragged_attention import ragged_attention_xla


def attend(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    positions: jax.Array,
    plan: AttentionPlan,
) -> jax.Array:
    """q: [T, H, hd] (RoPE applied); k_pages, v_pages: [N, KVH, ps, hd] one layer's pool,
    already holding the step's keys; positions: [T] int32. Returns [T, H, hd] in q's dtype."""
    return ragged_attention_xla(q, k_pages, v_pages, positions, plan.passes, plan.chunk)
