"""The KV pool an engine on a TPU gets: the largest that fits each chip's HBM beside the
weights, the row store and the compiled programs' scratch, counted as `etjax plan` counts it.

On a TPU the pool is not sized for the work at hand (etjax/engine_build.py's buckets) but
for the chips: `plan_config` compiles the engine's own step programs (at two layers, for
the devices the engine runs on) and reads their memory analysis, and the pool is what is
left of `hbm_fraction` of a chip's HBM, as other engines fill a set share of a GPU's memory.
Elsewhere nothing is compiled and the caller sizes the pool as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax

from etjax.cache.page_allocator import pages_needed
from etjax.errors import ConfigError
from etjax.model.config import ModelConfig
from etjax.model.quantized import weight_formats, weights_bytes
from etjax.model.weights import Weights
from etjax.planning.topology import Topology
from etjax.runtime.options import RuntimeOptions

if TYPE_CHECKING:
    from etjax.planning.plan import Plan

# Pools already sized in this process, by model and options: every `decode()` call builds an
# engine, and the sizing compiles two programs.
_SIZED: dict[str, int] = {}


def pool_plan(
    cfg: ModelConfig,
    options: RuntimeOptions,
    devices: list,
    layers: int = 2,
    weights: Weights | None = None,
) -> Plan:
    """The plan (plan.py) of an engine with these options on `devices` (TPU devices, real or
    described), its programs compiled at `layers` layers for rows of the engine's context
    (`max_context`, else the model's): `max_pool_pages` is the largest KV
    pool that fits beside everything else in `options.hbm_fraction` of each chip's HBM.
    `weights`: the engine's own (int8 matrices take half of bfloat16's room); None: every
    weight in cfg.dtype. A ConfigError when not even one row of the planned context fits, or
    when the TPU compiler refuses one of the programs (as the engine's own would be)."""
    # plan.py builds the engine's device half: imported to size a pool, not with engine_build.py.
    from etjax.planning.plan import plan_config

    topo = Topology.of_devices(devices)
    context = options.context_limit(cfg.max_position_embeddings)
    found = plan_config(cfg, topo, options, context, layers=layers, weights=weights)
    if found.errors:  # the engine's own programs do not compile with these options
        raise ConfigError(
            "sizing the KV pool: "
            + "; ".join(found.errors)
            + f"; a shorter max_context (now {context} tokens) or a smaller max_batch_size "
            "shrinks the programs' attention work lists; etjax plan says what would fit"
        )
    row = pages_needed(found.context + options.steps_per_sync, options.page_size)
    if found.max_pool_pages < row + 1:
        raise ConfigError(
            f"the KV pool: {found.max_pool_pages} pages fit beside the weights and programs "
            f"in {options.hbm_fraction:.0%} of {topo.name}'s HBM, fewer than one row of "
            f"{found.context} tokens takes ({row}); a shorter max_context serves shorter "
            "requests in the room there is; etjax plan says what would fit"
        )
    return found


def device_pool_pages(
    cfg: ModelConfig, options: RuntimeOptions, weights: Weights | None = None
) -> int | None:
    """The pool an engine on this process's TPU gets (`pool_plan` over the devices its
    mesh takes, beside `weights`, the engine's; sized once per model, weights' form and
    options); None off a TPU, where the caller sizes it."""
    if jax.default_backend() != "tpu":
        return None
    form = None if weights is None else (weights_bytes(weights), weight_formats(weights))
    key = repr((cfg, options, form))
    if key not in _SIZED:
        devices = jax.devices()[: options.mesh_shape.size]
        _SIZED[key] = pool_plan(cfg, options, devices, weights=weights).max_pool_pages
    return _SIZED[key]
