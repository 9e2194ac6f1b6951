"""`attend`: dense attention of a step's tokens over the paged cache, as its plan describes.

Dense attention runs the ragged kernel of the plan's backend (backend.py): `xla`
(pallas_kernels/ragged_attention/xla.py, every platform), `pallas_gpu` (pallas_gpu.py,
Triton) or, on a TPU, `pallas_tpu` (pallas_tpu.py: xla.py's passes on a Mosaic kernel that
reads the pages in place). The project's own kernel rather than JAX's ragged paged attention:
that one wants keys and values interleaved in one pool `[pages, page_size, 2 * KV heads,
head_dim]`, while this cache keeps one contiguous `[page_size, head_dim]` tile per page and KV
head, the block the pruned kernels fetch and per-head pruning keeps or drops; and JAX 0.10.2's
TPU interpret mode fails on it ("'ReshapeTransform' object has no attribute 'indices'"), so
it could not be checked against the reference here (docs/TPU.md compares the bytes each reads).
Pruned decode attention (pruned.py) runs the project's block-sparse kernels: Pallas on TPU
and GPU, XLA elsewhere.

Why a pruned step is not the upstream kernel over each row's compacted kept pages (which
would be exact: keys are cached after RoPE, and a row's kept list ends with its last, partly
filled page, so the kept length is (count - 1) * page_size + the tail): the selection ranks
pages by the attention mass they drew when last read (`mass_threshold`, on by default), and
that mass comes from the per-block log-sum-exps the block-sparse kernels return; the upstream
kernel returns only the merged output. Per-head selection (`share_heads` off) would also need
one page list per KV head, where the upstream kernel takes one per sequence.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from etjax.attention.plan import AttentionPlan


def attend(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    positions: jax.Array,
    plan: AttentionPlan,
    first_page: jax.Array | int = 0,
    local: jax.Array | bool = False,
    softcap: float = 0.0,
) -> jax.Array:
    """q: [T, H, hd] (RoPE applied); k_pages, v_pages: [N, KVH, ps, hd] a pool of pages already
    holding the step's keys; positions: [T] int32; first_page: the pool page of the plan's page
    0 (a layer's offset in the cache's pool, etjax/cache/kv_cache.py); local: whether this is
    a sliding-window layer (a traced bool inside the layer scan): it then sees only the last
    `plan.window` positions and reads only their pages; softcap: scores s become
    softcap * tanh(s / softcap) (Gemma 2's attention logit cap, a model constant; 0: none).
    Returns [T, H, hd] in q's dtype."""
    passes, window = plan.passes, 0
    if plan.window > 0:
        passes = jax.tree.map(lambda a, b: jnp.where(local, a, b), plan.local, plan.passes)
        window = jnp.where(local, plan.window, 0).astype(jnp.int32)
    passes = tuple(p._replace(item_pages=p.item_pages + first_page) for p in passes)
    return plan.backend.ragged(
        q, k_pages, v_pages, positions, passes, plan.chunk, window, softcap, plan.shared
    )
