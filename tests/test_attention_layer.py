"""`check_plans` (etjax/attention/layer.py) refuses, before anything is traced, the plans no
layer can attend with, each with its reason."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import pytest

from etjax.attention import XLA, AttentionPlan, SparsePlan, check_plans
from etjax.pruning.config import PruningConfig

_CFG = PruningConfig(enabled=True)
_PRUNES = dataclasses.replace(XLA, pruning=_CFG.shape())


def _sparse(slots=None) -> SparsePlan:
    return SparsePlan(
        budget_blocks=jnp.ones((2,), jnp.int32),
        page_table=jnp.zeros((2, 4), jnp.int32),
        thresholds=_CFG.thresholds(),
        max_kept=4,
        slots=slots,
    )


def _plan(sparse=None, window=0, backend=_PRUNES, passes=()) -> AttentionPlan:
    sparse = {None: None, "rows": _sparse(), "ragged": _sparse(jnp.arange(2))}[sparse]
    return AttentionPlan(passes=passes, backend=backend, window=window, sparse=sparse)


@pytest.mark.parametrize(
    ("plan", "window", "softcap", "reason"),
    [
        (None, 0, 0.0, "needs an attention plan"),
        (_plan("ragged"), 0, 0.0, "needs passes for the tokens that are not rows"),
        (_plan(window=8), 16, 0.0, "a window of 8 positions"),
        (_plan("rows"), 8, 0.0, "a window of 0 positions"),  # local layers, no local passes
        (_plan("rows"), 0, 50.0, "does not soft-cap"),
        (_plan("rows", backend=XLA), 0, 0.0, "does not prune"),
    ],
)
def test_plans_no_layer_can_run_are_refused(plan, window, softcap, reason):
    with pytest.raises(ValueError, match=reason):
        check_plans(plan, window, softcap)


def test_plans_a_layer_can_run_pass():
    check_plans(_plan(backend=XLA), 0, 30.0)  # dense, capped
    check_plans(_plan("rows"), 0, 0.0)  # a burst of pruned rows, no dense work
    check_plans(_plan("ragged", window=8, passes=(None,)), 8, 0.0)
