"""RMSNorm (etjax/model/layers.py `rms_norm`, Gemma 3's `gemma_norm`): a row's result has the
same bits alone and among any number of rows, as the engine's speculation needs (a verifying
step of 8 rows must norm a position as a burst's single row does), and equals the float64
formula within float32 rounding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from etjax.model.families.gemma3 import gemma_norm
from etjax.model.layers import rms_norm

NORMS = {"rms_norm": rms_norm, "gemma_norm": gemma_norm}


@pytest.mark.parametrize("name", sorted(NORMS))
@pytest.mark.parametrize("width", [576, 640, 7])
def test_a_rows_norm_is_the_same_alone_and_among_others(name, width):
    rng = np.random.default_rng(width)
    x = jnp.asarray(rng.standard_normal((16, width)).astype(np.float32) * 3)
    scale = jnp.asarray(rng.standard_normal(width).astype(np.float32))
    norm = jax.jit(lambda rows: NORMS[name](rows, scale, 1e-6))
    together = np.asarray(norm(x))
    for count in (1, 2, 3, 7, 8, 9):
        assert np.array_equal(np.asarray(norm(x[:count])), together[:count]), count
    x64 = np.asarray(x, np.float64)
    expected = x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + 1e-6) * np.asarray(scale)
    assert np.abs(together - expected).max() <= 1e-5 * np.abs(expected).max()
