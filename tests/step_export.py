"""The ragged step lowered for a platform this host may not have: `jax.export` of `mixed_step`
at a model's real shapes, with the attention kernels that platform's engine would choose.

On a CPU host this lowers the step for a TPU (the Pallas kernels to Mosaic) or a CUDA GPU (to
Triton) without running it: what a change does to the accelerators' programs is caught here,
by tests/test_export.py, before anyone has one at hand. Nothing but shapes is needed: the
weights are abstract (`abstract_weights`), and the step's other inputs are those an engine
builds for one decoding row beside one prefill chunk.
"""

from __future__ import annotations

import dataclasses
import inspect

import jax
import numpy as np
from jax import export

from etjax.attention import kept_table_width, resolve_backend
from etjax.engine import device as device_module
from etjax.engine.backend import PrefillJob
from etjax.engine.device import DeviceBackend
from etjax.model.config import ModelConfig
from etjax.model.weights import abstract_weights
from etjax.runtime.options import RuntimeOptions
from etjax.runtime.steps import mixed_step

TRITON_CALL = "__gpu$xla.gpu.triton"
EXPORT_PAGES = 64  # a pool's size shapes only the cache; the step's program is the same


class _Captured(Exception):
    pass


def ragged_step_inputs(cfg: ModelConfig, options: RuntimeOptions) -> tuple[tuple, dict]:
    """The arguments an engine with `options` passes `mixed_step` for one decoding row (20
    tokens cached) beside a 40-token prefill chunk, as shapes (`jax.ShapeDtypeStruct`)."""
    backend = DeviceBackend(abstract_weights(cfg), cfg, (0,), options, EXPORT_PAGES)
    captured: dict = {}

    def capture(*args, **kwargs):
        captured.update(args=args, kwargs=kwargs)
        raise _Captured

    page = options.page_size
    job = PrefillJob(
        row=1, tokens=list(range(3, 43)), start=0, pages=[3, 4, 5, 6][: 40 // page + 1]
    )
    original, device_module.mixed_step = device_module.mixed_step, capture
    try:
        backend.mixed([0], [[1, 2]], [20], [1.0], [job])
    except _Captured:
        pass
    finally:
        device_module.mixed_step = original
    # The device passes the step's arguments by keyword: put them back in the step's order.
    call = inspect.signature(mixed_step).bind(*captured["args"], **captured["kwargs"])
    call.apply_defaults()
    *arrays, statics, max_draft = call.args
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), arrays)
    return (*shapes, statics, max_draft), {}


def export_ragged_step(cfg: ModelConfig, options: RuntimeOptions, platform: str) -> export.Exported:
    """`mixed_step` lowered for `platform` ("tpu", "cuda" or "cpu") with the kernels its
    engine resolves there (`attention_backend`), at `cfg`'s shapes."""
    args, kwargs = ragged_step_inputs(cfg, options)
    (*arrays, plan, page_table, thresholds, statics, max_draft) = args
    kernels = resolve_backend(options.attention_backend, platform, pruning=options.pruning.shape())
    plan = plan.replace(backend=kernels)
    max_kept = statics.max_kept  # the CPU engine's: the whole table (kept_table_width)
    if max_kept:  # the platform's width for a step that keeps that many blocks
        max_kept = kept_table_width(kernels, max_kept, page_table.shape[1])
    statics = dataclasses.replace(statics, attention_backend=kernels, max_kept=max_kept)
    # Triton kernels carry no compatibility guarantee across jaxlib versions (Mosaic's do):
    # an exported CUDA step runs only with the jaxlib that lowered it.
    lowered = export.export(
        mixed_step,
        platforms=(platform,),
        disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON_CALL)],
    )
    return lowered(*arrays, plan, page_table, thresholds, statics, max_draft, **kwargs)
