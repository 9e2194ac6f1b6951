"""The CPU row-products kernel (cpp_kernels/row_products.cc, chosen by
etjax/model/products.py) against float64 NumPy: every row count a decode step or a small
chunk has, weights of 32 and 16 bits, each row's result independent of the rows beside it;
and the choice itself: on for the engine's CPU step programs, off outside them, off past its
shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpp_kernels import cpu_kernels_available
from cpp_kernels.targets import ROW_PRODUCTS
from etjax.model import products
from etjax.model.products import project, row_products
from pallas_kernels.row_products.cpu import MAX_KERNEL_ROWS

pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="no C++ compiler")

IN, OUT = 96, 44  # K: six 16-float lanes; N: eleven groups of 4, more than one unit's 8


def _kernel(x, w):
    with row_products(True):
        return jax.jit(project)(x, w)


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 13, MAX_KERNEL_ROWS])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_row_products_match_numpy(rows, dtype):
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, IN)).astype(np.float32)
    w = jnp.asarray(rng.standard_normal((OUT, IN)), dtype)
    expected = x.astype(np.float64) @ np.asarray(w.astype(jnp.float32), np.float64).T
    got = np.asarray(_kernel(jnp.asarray(x), w))
    assert got.dtype == np.float32 and got.shape == (rows, OUT)
    # A float32 sum of 96 products of unit normals: a few ulps of its magnitude (~10).
    np.testing.assert_allclose(got, expected, rtol=0, atol=2e-5)


def test_a_rows_product_does_not_depend_on_the_rows_beside_it():
    # Bit for bit: the batch a row decodes in never changes its logits (alone equals batched).
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((11, IN)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((OUT, IN)), jnp.float32)
    together = np.asarray(_kernel(x, w))
    for i in (0, 4, 10):
        np.testing.assert_array_equal(np.asarray(_kernel(x[i : i + 1], w))[0], together[i])
    np.testing.assert_array_equal(np.asarray(_kernel(x[3:9], w)), together[3:9])


def test_leading_axes_are_flattened_into_rows():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((2, 3, IN)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((OUT, IN)), jnp.float32)
    expected = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    np.testing.assert_allclose(np.asarray(_kernel(x, w)), expected, rtol=0, atol=2e-5)


def _runs_kernel(x, w, enabled=True, out_dtype=None) -> bool:
    with row_products(enabled):
        text = jax.jit(lambda x, w: project(x, w, out_dtype)).lower(x, w).as_text()
    return ROW_PRODUCTS.name in text


def test_the_kernel_runs_only_where_it_is_chosen_and_takes_the_shapes():
    x = jnp.zeros((8, IN), jnp.float32)
    w = jnp.zeros((OUT, IN), jnp.float32)
    assert _runs_kernel(x, w)
    assert not _runs_kernel(x, w, enabled=False)  # outside the engine's CPU step programs
    assert not products._ENABLED.get()  # the context is left as it was found
    assert not _runs_kernel(jnp.zeros((MAX_KERNEL_ROWS + 1, IN), jnp.float32), w)  # a chunk
    assert not _runs_kernel(x.astype(jnp.bfloat16), w)  # bfloat16 activations
    assert not _runs_kernel(jnp.zeros((8, IN - 8), jnp.float32), w[:, :-8])  # K off the lanes
    assert not _runs_kernel(x, w[:-2])  # N not a multiple of 4
    assert not _runs_kernel(x, w, out_dtype=jnp.bfloat16)
