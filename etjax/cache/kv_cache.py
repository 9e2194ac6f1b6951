"""The paged KV cache on device.

Each layer owns a pool of pages `[num_pages, num_kv_heads, page_size, head_dim]` for keys and
one for values, stacked on a leading layer axis. Within a page the KV heads are outermost, so one
head's slice of a page is a contiguous `[page_size, head_dim]` tile: the block a Pallas kernel
fetches (TPU tiles must end in two full or (8, 128)-aligned dimensions) and the unit per-head
pruning keeps or drops. A page is also the unit of allocation.
Page 0 is the null page: it is never allocated, unused page-table entries point at it, and
writes from padding tokens land in it, so real pages only ever hold real tokens.

A forward pass reads the cache as `PagePool`: the layer axis folded into the page axis (a free
reshape), so layer l's page p is pool page `l * num_pages + p`. Every kernel then takes one
pool of pages and page ids, whatever the layer, and the layer loop can be a `lax.scan` that
touches only the pages it reads and writes, never a copy of a layer's slice.
"""

from __future__ import annotations

import functools
from typing import ClassVar, Protocol

import flax.struct
import jax
import jax.numpy as jnp

from etjax.pruning.block_scores import update_key_bounds


class KVShape(Protocol):
    """What the cache needs of a model (etjax/model/config.py `ModelConfig` has it): the
    cache sits below the model, which writes into it, so it names no model type."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    @property
    def jnp_dtype(self) -> jnp.dtype: ...


NULL_PAGE = 0


@flax.struct.dataclass
class KVCache:
    """Key and value page pools of every layer. L = layers, N = num_pages, ps = page_size."""

    k: jax.Array  # [L, N, KVH, ps, hd]
    v: jax.Array  # [L, N, KVH, ps, hd]
    # Elementwise bounds of the keys each page holds, per KV head, for query-aware block scores
    # (etjax/pruning/block_scores.py); kept current by every write.
    k_min: jax.Array  # [L, N, KVH, hd] float32
    k_max: jax.Array  # [L, N, KVH, hd] float32
    # Attention mass each block of a row's sequence drew, per KV head, the last time a pruned
    # decode step of that row read it; 0 for blocks it never read that way
    # (etjax/pruning/block_scores.py). Kept per resident row and logical block, not per page:
    # a page shared by several sequences (etjax/cache/prefix_cache.py) draws a different mass
    # from each. M = resident rows (the engine's store rows), W = the pruned page-table width;
    # [L, 1, 1, KVH] where nothing ranks by mass.
    block_mass: jax.Array  # [L, M, W, KVH] float32

    # Each array's dimensions by name, for the mesh placement (etjax/distributed/placement.py).
    AXES: ClassVar[dict[str, tuple[str | None, ...]]] = {
        "k": ("layers", "pages", "kv_heads", None, "head_dim"),
        "v": ("layers", "pages", "kv_heads", None, "head_dim"),
        "k_min": ("layers", "pages", "kv_heads", "head_dim"),
        "k_max": ("layers", "pages", "kv_heads", "head_dim"),
        "block_mass": ("layers", None, None, "kv_heads"),
    }

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    @property
    def page_size(self) -> int:
        return self.k.shape[3]


@flax.struct.dataclass
class PagePool:
    """The cache with layers folded into pages: leaves of `KVCache` without their layer axis,
    `[L * N, ...]`. `pages_per_layer` (N) turns a layer's page id into a pool page id, and
    `mass_rows_per_layer` (M) a row's block-mass row into the pool's."""

    k: jax.Array  # [L * N, KVH, ps, hd]
    v: jax.Array
    k_min: jax.Array  # [L * N, KVH, hd]
    k_max: jax.Array
    block_mass: jax.Array  # [L * M, W, KVH]
    pages_per_layer: int = flax.struct.field(pytree_node=False)
    mass_rows_per_layer: int = flax.struct.field(pytree_node=False, default=1)


def page_pool(cache: KVCache) -> PagePool:
    """`cache` as one pool of pages (a reshape; no copy)."""
    fold = lambda a: a.reshape(-1, *a.shape[2:])  # noqa: E731
    return PagePool(
        k=fold(cache.k),
        v=fold(cache.v),
        k_min=fold(cache.k_min),
        k_max=fold(cache.k_max),
        block_mass=fold(cache.block_mass),
        pages_per_layer=cache.num_pages,
        mass_rows_per_layer=cache.block_mass.shape[1],
    )


def cache_from_pool(pool: PagePool) -> KVCache:
    """The inverse of `page_pool`."""
    unfold = lambda a: a.reshape(-1, pool.pages_per_layer, *a.shape[1:])  # noqa: E731
    return KVCache(
        k=unfold(pool.k),
        v=unfold(pool.v),
        k_min=unfold(pool.k_min),
        k_max=unfold(pool.k_max),
        block_mass=pool.block_mass.reshape(
            -1, pool.mass_rows_per_layer, *pool.block_mass.shape[1:]
        ),
    )


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5))
def init_kv_cache(
    cfg: KVShape,
    num_pages: int,
    page_size: int,
    mass_rows: int = 1,
    mass_width: int = 1,
    dtype: str | None = None,
) -> KVCache:
    """Zero-filled cache with `num_pages` pages per layer (page 0 included) of `page_size`
    tokens (one compiled program per size), and a block mass for `mass_rows` rows of
    `mass_width` blocks (pruning that ranks blocks by mass; the default keeps none).
    dtype: of the keys and values ("float32", "bfloat16"); None: the model's."""
    layers, heads = cfg.num_layers, cfg.num_kv_heads
    bounds = (layers, num_pages, heads, cfg.head_dim)
    pages = (layers, num_pages, heads, page_size, cfg.head_dim)
    kv_dtype = kv_jnp_dtype(cfg, dtype)
    return KVCache(
        k=jnp.zeros(pages, kv_dtype),
        v=jnp.zeros(pages, kv_dtype),
        k_min=jnp.full(bounds, jnp.inf, jnp.float32),
        k_max=jnp.full(bounds, -jnp.inf, jnp.float32),
        block_mass=jnp.zeros((layers, mass_rows, mass_width, heads), jnp.float32),
    )


def kv_jnp_dtype(cfg: KVShape, dtype: str | None = None) -> jnp.dtype:
    """The keys' and values' dtype: `dtype` ("float32", "float16", "bfloat16") or, None, the
    model's."""
    return cfg.jnp_dtype if dtype is None else jnp.dtype(dtype)


def kv_cache_bytes(cfg: KVShape, num_pages: int, page_size: int, dtype: str | None = None) -> int:
    """Device bytes a cache of this size occupies (keys and values of `dtype`, None: the
    model's)."""
    itemsize = kv_jnp_dtype(cfg, dtype).itemsize
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize
    return num_pages * page_size * per_token


def write_kv(
    pool: PagePool,
    k_new: jax.Array,
    v_new: jax.Array,
    pages: jax.Array,
    positions: jax.Array,
    first_page: jax.Array | int = 0,
) -> PagePool:
    """Scatter new keys and values into their pages and fold the keys into the page bounds.

    k_new, v_new: [T, KVH, hd]; pages: [T] int32 the (layer's) page each token's position falls
    in, the null page for padding tokens; positions: [T] absolute positions (the slot is
    position % page_size); first_page: the pool page of the layer's page 0.
    """
    page_size = pool.k.shape[2]
    slot = jnp.where(pages == NULL_PAGE, 0, positions % page_size)
    pages = pages + first_page
    # The bounds are of the keys as stored (rounded to a narrower cache dtype), so they bound
    # what attention reads.
    k_new, v_new = _storable(k_new, pool.k.dtype), _storable(v_new, pool.v.dtype)
    k = _scatter_tokens(pool.k, k_new, pages, slot)
    v = _scatter_tokens(pool.v, v_new, pages, slot)
    k_min, k_max = update_key_bounds(pool.k_min, pool.k_max, k_new, pages, slot)
    return pool.replace(k=k, v=v, k_min=k_min, k_max=k_max)


def _scatter_tokens(store: jax.Array, new: jax.Array, pages: jax.Array, slot: jax.Array):
    """store [N, KVH, ps, hd] with token t's heads new[t] [KVH, hd] at (pages[t], slot[t])."""
    # The TPU compiler lays the pool out for a head-sliced scatter otherwise than for the
    # attention that reads it, and copied the whole pool between the two in every layer of a
    # multi-row step (Llama-3.1-8B on a v5e: 2.4 GB a layer at 4 rows, docs/TPU.md); indexing
    # the heads too writes the same values in place. On a CPU the head slice is the faster
    # scatter (26 against 54 us for 512 float32 tokens).
    return jax.lax.platform_dependent(
        store, new, pages, slot, tpu=scatter_head_indexed, default=scatter_head_slice
    )


def scatter_head_slice(store, new, pages, slot):
    """`_scatter_tokens` with the heads a slice: advanced indices on axes 0 and 2 around it
    put [T] first, [T, KVH, hd]."""
    return store.at[pages, :, slot].set(new, mode="drop")


def scatter_head_indexed(store, new, pages, slot):
    """`_scatter_tokens` with every (token, head) pair indexed: the same values."""
    heads = jnp.arange(store.shape[1])
    return store.at[pages[:, None], heads[None, :], slot[:, None]].set(new, mode="drop")


def _storable(x: jax.Array, dtype) -> jax.Array:
    # float16 tops out at 65504: a larger key or value is stored as the largest finite one
    # (saturated), never as inf, which would turn every score it meets into NaN.
    if jnp.dtype(dtype) == jnp.float16:
        limit = float(jnp.finfo(jnp.float16).max)
        x = jnp.clip(x, -limit, limit)
    return x.astype(dtype)


@functools.partial(jax.jit, donate_argnums=(0,))
def forget_row_mass(cache: KVCache, row: jax.Array) -> KVCache:
    """Clear the block mass of resident row `row` (a new sequence takes it over)."""
    return cache.replace(block_mass=cache.block_mass.at[:, row].set(0.0, mode="drop"))


@functools.partial(jax.jit, donate_argnums=(0,))
def copy_page(cache: KVCache, source: jax.Array, dest: jax.Array) -> KVCache:
    """Page `dest` of every layer becomes a copy of page `source`: keys, values and their
    bounds (a sequence forked from another takes its partly filled last page this way)."""

    def copied(pool: jax.Array) -> jax.Array:
        return pool.at[:, dest].set(pool[:, source])

    return cache.replace(
        k=copied(cache.k), v=copied(cache.v), k_min=copied(cache.k_min), k_max=copied(cache.k_max)
    )


def token_pages(
    page_table: jax.Array, positions: jax.Array, real: jax.Array, page_size: int
) -> jax.Array:
    """The page each token writes to, on the device (for decode steps, whose positions advance):
    row t of page_table [T, P] is token t's sequence; positions: [T]; real: [T] bool. The null
    page where not real."""
    logical = jnp.clip(positions // page_size, 0, page_table.shape[1] - 1)
    page = jnp.take_along_axis(page_table, logical[:, None], axis=1)[:, 0]
    return jnp.where(real, page, NULL_PAGE)
