"""`attend`: dense attention of a step's tokens over the paged cache, as its plan describes;
and `resolve_backend`, the choice of kernels by platform.

Dense attention runs the XLA backend on every platform today
(pallas_kernels/ragged_attention/xla.py); its plan carries what JAX's TPU ragged paged attention
kernel also takes (per-sequence query offsets, KV lengths and page lists), so a kernel backend
slots in here without the model or the engine changing. Pruned decode attention
(pruned.py) runs the project's block-sparse kernels: Pallas on TPU and GPU, XLA elsewhere.
"""

from __future__ import annotations

import jax

from etjax.attention.plan import AttentionPlan
from pallas_kernels.ragged_attention import ragged_attention_xla

BACKENDS = ("auto", "xla", "pallas_tpu", "pallas_gpu")


def resolve_backend(name: str, platform: str | None = None) -> str:
    """The kernels `name` selects on `platform` (default: JAX's default backend): "auto" is
    "pallas_tpu" on a TPU, "pallas_gpu" on a GPU and "xla" elsewhere."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend={name!r}; must be one of {BACKENDS}")
    if name != "auto":
        return name
    platform = platform or jax.default_backend()
    return {"tpu": "pallas_tpu", "gpu": "pallas_gpu", "cuda": "pallas_gpu"}.get(platform, "xla")


def attend(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    positions: jax.Array,
    plan: AttentionPlan,
    first_page: jax.Array | int = 0,
) -> jax.Array:
    """q: [T, H, hd] (RoPE applied); k_pages, v_pages: [N, KVH, ps, hd] a pool of pages already
    holding the step's keys; positions: [T] int32; first_page: the pool page of the plan's page
    0 (a layer's offset in the cache's pool, etjax/cache/kv_cache.py). Returns [T, H, hd] in
    q's dtype."""
    passes = tuple(p._replace(item_pages=p.item_pages + first_page) for p in plan.passes)
    return ragged_attention_xla(q, k_pages, v_pages, positions, passes, plan.chunk)
