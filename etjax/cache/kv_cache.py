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

import functools

import flax.struct
import jax
import jax.numpy as jnp

from etjax.model.config import ModelConfig
from etjax.pruning.block_scores import forget_mass, update_key_bounds

NULL_PAGE = 0


@flax.struct.dataclass
class KVCache:
    """Per-layer key and value page pools. N = num_pages, ps = page_size."""

    k: tuple[jax.Array, ...]  # num_layers x [N, KVH, ps, hd]
    v: tuple[jax.Array, ...]  # num_layers x [N, KVH, ps, hd]
    # Elementwise bounds of the keys each page holds, per KV head, for query-aware block scores
    # (etjax/pruning/block_scores.py); kept current by every write.
    k_min: tuple[jax.Array, ...]  # num_layers x [N, KVH, hd] float32
    k_max: tuple[jax.Array, ...]  # num_layers x [N, KVH, hd] float32
    # Attention mass each page drew, per KV head, the last time a pruned decode step read it;
    # 0 for pages never read that way (etjax/pruning/block_scores.py).
    block_mass: tuple[jax.Array, ...]  # num_layers x [N, KVH] float32

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[0]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[2]


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def init_kv_cache(cfg: ModelConfig, num_pages: int, page_size: int) -> KVCache:
    """Zero-filled cache with `num_pages` pages (page 0 included) of `page_size` tokens (one
    compiled program per size)."""
    shape = (num_pages, cfg.num_kv_heads, page_size, cfg.head_dim)
    zeros = lambda: jnp.zeros(shape, cfg.jnp_dtype)  # noqa: E731
    bounds = (num_pages, cfg.num_kv_heads, cfg.head_dim)
    return KVCache(
        k=tuple(zeros() for _ in range(cfg.num_layers)),
        v=tuple(zeros() for _ in range(cfg.num_layers)),
        k_min=tuple(jnp.full(bounds, jnp.inf, jnp.float32) for _ in range(cfg.num_layers)),
        k_max=tuple(jnp.full(bounds, -jnp.inf, jnp.float32) for _ in range(cfg.num_layers)),
        block_mass=tuple(jnp.zeros(bounds[:2], jnp.float32) for _ in range(cfg.num_layers)),
    )


def kv_cache_bytes(cfg: ModelConfig, num_pages: int, page_size: int) -> int:
    """Device bytes a cache of this size occupies."""
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * cfg.jnp_dtype.itemsize
    return num_pages * page_size * per_token


def write_kv(
    layer: LayerKV, k_new: jax.Array, v_new: jax.Array, pages: jax.Array, positions: jax.Array
) -> LayerKV:
    """Scatter new keys and values into their pages and fold the keys into the page bounds.

    k_new, v_new: [T, KVH, hd]; pages: [T] int32 the page each token's position falls in (the
    null page for padding tokens); positions: [T] absolute positions (the slot is
    position % page_size).
    """
    page_size = layer.k.shape[2]
    slot = jnp.where(pages == NULL_PAGE, 0, positions % page_size)
    # Advanced indices on axes 0 and 2 around the head slice put [T] first: [T, KVH, hd].
    k = layer.k.at[pages, :, slot].set(k_new.astype(layer.k.dtype), mode="drop")
    v = layer.v.at[pages, :, slot].set(v_new.astype(layer.v.dtype), mode="drop")
    k_min, k_max = update_key_bounds(layer.k_min, layer.k_max, k_new, pages, slot)
    block_mass = forget_mass(layer.block_mass, pages, slot)
    return LayerKV(k=k, v=v, k_min=k_min, k_max=k_max, block_mass=block_mass)


def token_pages(
    page_table: jax.Array, positions: jax.Array, real: jax.Array, page_size: int
) -> jax.Array:
    """The page each token writes to, on the device (for decode steps, whose positions advance):
    row t of page_table [T, P] is token t's sequence; positions: [T]; real: [T] bool. The null
    page where not real."""
    logical = jnp.clip(positions // page_size, 0, page_table.shape[1] - 1)
    page = jnp.take_along_axis(page_table, logical[:, None], axis=1)[:, 0]
    return jnp.where(real, page, NULL_PAGE)


@flax.struct.dataclass
class LayerKV:
    """One layer's slice of the cache (see KVCache for the shapes)."""

    k: jax.Array
    v: jax.Array
    k_min: jax.Array
    k_max: jax.Array
    block_mass: jax.Array


def cache_layers(cache: KVCache) -> list[LayerKV]:
    """The cache as one `LayerKV` per layer."""
    return [
        LayerKV(*parts)
        for parts in zip(cache.k, cache.v, cache.k_min, cache.k_max, cache.block_mass, strict=True)
    ]


def cache_from_layers(layers: list[LayerKV]) -> KVCache:
    """Reassemble a `KVCache` from per-layer slices."""
    return KVCache(
        k=tuple(x.k for x in layers),
        v=tuple(x.v for x in layers),
        k_min=tuple(x.k_min for x in layers),
        k_max=tuple(x.k_max for x in layers),
        block_mass=tuple(x.block_mass for x in layers),
    )
