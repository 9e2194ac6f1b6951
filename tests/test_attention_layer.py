"""`check_plans` (etjax/attention/layer.py) refuses, before anything is traced, the plans no
layer can attend with, each with its reason."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from etjax.attention import AttentionPlan, SparsePlan, check_plans
from etjax.pruning.config import PruningConfig

_CFG = PruningConfig(enabled=True)


def _sparse(slots=None) -> SparsePlan:
    return SparsePlan(
        budget_blocks=jnp.ones((2,), jnp.int32),
        page_table=jnp.zeros((2, 4), jnp.int32),
        thresholds=_CFG.thresholds(),
        pruning=_CFG.shape(),
        max_kept=4,
        slots=slots,
    )


@pytest.mark.parametrize(
    ("plan", "sparse", "window", "softcap", "local", "reason"),
    [
        (None, None, 0, 0.0, False, "needs an attention plan"),
        (None, "ragged", 0, 0.0, False, "needs an attention plan"),
        (AttentionPlan(passes=(), window=8), None, 16, 0.0, True, "a window of 8 positions"),
        (None, "rows", 0, 50.0, False, "does not soft-cap"),
        (None, "rows", 8, 0.0, True, "sliding-window layers needs a plan"),
    ],
)
def test_plans_no_layer_can_run_are_refused(plan, sparse, window, softcap, local, reason):
    sparse = {None: None, "rows": _sparse(), "ragged": _sparse(jnp.arange(2))}[sparse]
    with pytest.raises(ValueError, match=reason):
        check_plans(plan, sparse, window, softcap, local)


def test_plans_a_layer_can_run_pass():
    check_plans(AttentionPlan(passes=()), None, 0, 30.0, False)  # dense, capped
    check_plans(None, _sparse(), 0, 0.0, False)  # a burst of pruned rows, no plan
    check_plans(AttentionPlan(passes=(), window=8), _sparse(jnp.arange(2)), 8, 0.0, True)
