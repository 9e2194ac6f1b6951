"""The paged KV cache on device.

Each layer owns a pool of pages `[num_pages, num_kv_heads, page_size, head_dim]` for keys and
one for values. Within a page the KV heads are outermost, so one head's slice of a page is a
contiguous `[page_size, head_dim]` tile: the block a Pallas kernel fetches (TPU tiles must end in
two full or (8, 128)-aligned dimensions) and the unit per-head pruning keeps or drops. A page
is also the unit of allocation.
Page 0 is the null page: it is never allocated, unused page-table entries point at it, and
writes from padding tokens land in it, so real pages only ever hold real tokens.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from etjax.model.config import ModelConfig

NULL_PAGE = 0


@flax.struct.dataclass
class KVCache:
    """Per-layer key and value page pools. N = num_pages, ps = page_size."""

    k: tuple[jax.Array, ...]  # num_layers x [N, KVH, ps, hd]
    v: tuple[jax.Array, ...]  # num_layers x [N, KVH, ps, hd]

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[0]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[2]


def init_kv_cache(cfg: ModelConfig, num_pages: int, page_size: int) -> KVCache:
    """Zero-filled cache with `num_pages` pages (page 0 included) of `page_size` tokens."""
    shape = (num_pages, cfg.num_kv_heads, page_size, cfg.head_dim)
    zeros = lambda: jnp.zeros(shape, cfg.jnp_dtype)  # noqa: E731
    return KVCache(
        k=tuple(zeros() for _ in range(cfg.num_layers)),
        v=tuple(zeros() for _ in range(cfg.num_layers)),
    )


def kv_cache_bytes(cfg: ModelConfig, num_pages: int, page_size: int) -> int:
    """Device bytes a cache of this size occupies."""
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * cfg.jnp_dtype.itemsize
    return num_pages * page_size * per_token


def write_kv(
    k_pages: jax.Array,
    v_pages: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    page_table: jax.Array,
    positions: jax.Array,
    valid: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Scatter new keys and values into their pages.

    k_new, v_new: [B, S, KVH, hd]; page_table: [B, P]; positions: [B, S] absolute positions;
    valid: [B, S] bool. Invalid (padding) tokens are sent to the null page.
    """
    page_size = k_pages.shape[2]
    logical_page = jnp.clip(positions // page_size, 0, page_table.shape[1] - 1)
    page = jnp.take_along_axis(page_table, logical_page, axis=1)
    page = jnp.where(valid, page, NULL_PAGE)
    slot = jnp.where(valid, positions % page_size, 0)
    # Advanced indices on axes 0 and 2 around the head slice put [B, S] first: [B, S, KVH, hd].
    k_pages = k_pages.at[page, :, slot].set(k_new.astype(k_pages.dtype), mode="drop")
    v_pages = v_pages.at[page, :, slot].set(v_new.astype(v_pages.dtype), mode="drop")
    return k_pages, v_pages
