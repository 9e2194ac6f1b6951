"""A KV pool kept from one engine to the next of the same weights, so that a `decode()` call
on a CPU does not allocate and zero its pool again.

`decode()` builds an engine sized for its work and drops it when the call returns. For a
small workload the pool is MIN_POOL_PAGES pages (etjax/engine_build.py): 189 MB of float32
keys and values for SmolLM2-135M, and making it (zero-filled, every memory page touched for
the first time) took 85 ms of CPU time on a 2-core AMD EPYC Zen 4, under load, where a warm
call of 64 greedy tokens takes about a second. The engine that ends gives its pool back here,
and the next one of the same weights and shapes takes it (`take`).

What the pool holds needs no clearing: an engine reuses pages within its own life, so its
programs already treat a page as empty until its row writes it (the first write to a page
resets its key bounds, etjax/pruning/block_scores.py; attention reads no slot past a row's
length), and a pool another engine left is no different (tests/test_spare_pool.py: the same
outputs, bit for bit, as on a pool just made).

Only on a CPU, and one pool per process: an accelerator makes its pool at its memory's speed,
and there the pool fills the memory the weights leave, which a call must not hold once it
returns. The spare goes when its weights are collected or another pool is made.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

import jax

from etjax.cache.kv_cache import KVCache

# The one spare: (a weak reference to the weights it was made for, the pool), or None. A weak
# reference, so that the pool goes with its model.
_spare: tuple[weakref.ref, KVCache] | None = None
_LOCK = threading.Lock()


def take(owner, make: Callable[[], KVCache]) -> KVCache:
    """The spare pool if it was left by an engine of `owner` (the weights) and has `make`'s
    shapes and dtypes on the default device; else a new one from `make`, the spare dropped
    first."""
    global _spare
    with _LOCK:
        spare, _spare = _spare, None
    if spare is not None and spare[0]() is owner and _fits(spare[1], jax.eval_shape(make)):
        return spare[1]
    del spare  # freed before the new pool is allocated
    return make()


def give_back(owner, pool: KVCache) -> None:
    """Keep `pool` (an engine's, once it is done with it) for the next engine of `owner`, if
    it lives on a CPU and no step it was donated to failed."""
    global _spare
    leaves = jax.tree.leaves(pool)
    if any(x.is_deleted() for x in leaves):
        return
    if any(device.platform != "cpu" for x in leaves for device in x.devices()):
        return
    with _LOCK:
        _spare = (weakref.ref(owner, _forget), pool)


def _forget(ref: weakref.ref) -> None:
    # The weights are collected: their spare pool goes too.
    global _spare
    with _LOCK:
        if _spare is not None and _spare[0] is ref:
            _spare = None


def _fits(pool: KVCache, wanted) -> bool:
    have, want = jax.tree.leaves(pool), jax.tree.leaves(wanted)
    default = _default_device()
    return len(have) == len(want) and all(
        a.shape == b.shape
        and a.dtype == b.dtype
        and not a.is_deleted()
        and a.devices() == {default}
        for a, b in zip(have, want, strict=True)
    )


def _default_device() -> jax.Device:
    # Where a new array goes: `jax_default_device` (a device or a platform name), else the
    # first device.
    chosen = jax.config.jax_default_device
    if isinstance(chosen, str):
        return jax.devices(chosen)[0]
    return chosen or jax.devices()[0]
