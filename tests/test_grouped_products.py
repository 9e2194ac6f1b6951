"""The routed experts' CPU grouped-products kernel (cpp_kernels/grouped_products.cc,
chosen by etjax/model/products.py) against float64 NumPy: empty groups, one row, uneven
groups, rows in no group, weights of 32 and 16 bits (widened per row block, or once for a
large group), a bfloat16 model's rows, each row's result independent of the rows beside it;
a routed-experts layer on the kernel against the float64 top-k' mixture; and the choice: on
for the engine's CPU step programs, off outside them, off past its shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpp_kernels import cpu_kernels_available
from cpp_kernels.targets import GROUPED_PRODUCTS
from etjax.loaders.hf_config import hf_config_to_model_config
from etjax.model.experts import routed_experts
from etjax.model.products import grouped_product, row_products
from etjax.runtime.options import RuntimeOptions
from etjax.runtime.steps import mixed_step
from tests.step_export import ragged_step_inputs
from tests.test_entropy_experts import steered_reference
from tests.test_moe import tiny_qwen3_moe_config

pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="no C++ compiler")

# R rows, K: three 16-float lanes; N: eleven blocks of 4, more than one unit's 8; E groups.
ROWS, IN, OUT, GROUPS = 24, 48, 44, 6
SIZES = {
    "uneven, 4 in no group": [3, 0, 7, 1, 0, 9],
    "every group": [5, 4, 3, 2, 6, 4],
    "one row": [0, 0, 1, 0, 0, 0],
    "one group takes all": [0, 0, 0, 0, 0, ROWS],
    "no rows in any group": [0] * GROUPS,
}


def _jit(f):
    # A new function each time: jax caches a trace by function and arguments, not by the
    # context it was traced in.
    return jax.jit(lambda *args: f(*args))


def _kernel(x, w, sizes):
    with row_products(True):
        return _jit(grouped_product)(x, w, jnp.asarray(sizes, jnp.int32))


def grouped_reference(x, w, sizes):
    """float64: row r of group e times w[e].T; rows past the groups zero."""
    x, w = np.asarray(x, np.float64), np.asarray(jnp.asarray(w, jnp.float32), np.float64)
    out, start = np.zeros((x.shape[0], w.shape[1])), 0
    for e, size in enumerate(sizes):
        out[start : start + size] = x[start : start + size] @ w[e].T
        start += size
    return out


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_grouped_products_match_numpy(dtype):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((ROWS, IN)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((GROUPS, OUT, IN)), dtype)
    for name, sizes in SIZES.items():
        got = np.asarray(_kernel(x, w, sizes))
        assert got.dtype == np.float32 and got.shape == (ROWS, OUT)
        # A float32 sum of 48 products of unit normals: a few ulps of its magnitude (~7).
        np.testing.assert_allclose(got, grouped_reference(x, w, sizes), rtol=0, atol=2e-5)
        # XLA's ragged dot (outside the step programs) gives the same, rows in no group zero.
        xla = np.asarray(_jit(grouped_product)(x, w, jnp.asarray(sizes, jnp.int32)))
        np.testing.assert_allclose(got, xla, rtol=0, atol=2e-5, err_msg=name)


def test_bfloat16_rows_are_rounded_from_the_float32_sums():
    # A bfloat16 model's rows: widened for the kernel, the result rounded back (half an ulp of
    # bfloat16, 2^-9 relative, on top of the float32 sums').
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((ROWS, IN)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((GROUPS, OUT, IN)), jnp.bfloat16)
    sizes = SIZES["uneven, 4 in no group"]
    got = _kernel(x, w, sizes)
    assert got.dtype == jnp.bfloat16
    want = grouped_reference(x.astype(jnp.float32), w, sizes)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2**-8, atol=1e-6)


def test_a_rows_product_does_not_depend_on_the_rows_beside_it():
    # Bit for bit: row 5 (the third of a group of 7) alone in a group of one, first.
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((ROWS, IN)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((GROUPS, OUT, IN)), jnp.float32)
    together = np.asarray(_kernel(x, w, SIZES["uneven, 4 in no group"]))
    alone = np.asarray(_kernel(x.at[0].set(x[5]), w, [0, 0, 1, 0, 0, 0]))
    np.testing.assert_array_equal(alone[0], together[5])


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_16_bit_weights_widened_once_or_per_row_block_agree(dtype):
    # A group of more than 32 rows (a prompt chunk's) widens its weights once into a scratch,
    # smaller ones in registers per 4 rows (grouped_products.cc): both against float64, and
    # row 5 of the group of 36 bit for bit the same alone in a group of one.
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((40, IN)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((GROUPS, OUT, IN)), dtype)
    sizes = [0, 36, 0, 3, 0, 0]  # the last row in no group
    together = np.asarray(_kernel(x, w, sizes))
    np.testing.assert_allclose(together, grouped_reference(x, w, sizes), rtol=0, atol=2e-5)
    alone = np.asarray(_kernel(x.at[0].set(x[5]), w, [0, 1, 0, 0, 0, 0]))
    np.testing.assert_array_equal(alone[0], together[5])


@pytest.mark.parametrize("skew", [0.0, 8.0], ids=["spread", "one-expert"])
def test_routed_experts_on_the_kernel_equal_a_top_k_mixture(skew):
    # 13 tokens, 8 experts, top 3 renormalised: every token at k, and steered (k' of 1-3, the
    # dropped pairs in no group). "one-expert": a router sending every token to expert 5
    # first, so most experts have no rows.
    rng = np.random.default_rng(4)
    t, d, m, e = 13, 32, 16, 8
    x = rng.standard_normal((t, d)).astype(np.float32)
    router = rng.standard_normal((e, d)).astype(np.float32)
    router[5] += skew * x.mean(0) / np.square(x.mean(0)).sum()
    w_gate_up = rng.standard_normal((e, 2 * m, d)).astype(np.float32) * 0.3
    w_down = rng.standard_normal((e, d, m)).astype(np.float32) * 0.3
    layer = jax.jit(lambda *args: routed_experts(*args[:4], 3, True, args[4]))
    mixed = rng.integers(1, 4, size=t).astype(np.int32)
    with row_products(True):
        text = layer.lower(x, router, w_gate_up, w_down, mixed).as_text()
        assert GROUPED_PRODUCTS.name in text
        for active_k in (np.full(t, 3, np.int32), mixed):
            ours = np.asarray(layer(x, router, w_gate_up, w_down, active_k))
            want = steered_reference(x, router, w_gate_up, w_down, 3, True, active_k)
            np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-5)


def _runs_kernel(x, w, enabled=True) -> bool:
    sizes = jnp.zeros((w.shape[0],), jnp.int32)
    with row_products(enabled):
        text = _jit(grouped_product).lower(x, w, sizes).as_text()
    return GROUPED_PRODUCTS.name in text


def test_the_kernel_runs_only_where_it_is_chosen_and_takes_the_shapes():
    x = jnp.zeros((ROWS, IN), jnp.float32)
    w = jnp.zeros((GROUPS, OUT, IN), jnp.bfloat16)
    assert _runs_kernel(x, w)
    assert _runs_kernel(jnp.zeros((1024, IN), jnp.float32), w)  # a prompt chunk's rows too
    assert not _runs_kernel(x, w, enabled=False)  # outside the engine's CPU step programs
    assert _runs_kernel(x.astype(jnp.bfloat16), w)  # a bfloat16 model's rows, widened
    assert not _runs_kernel(x.astype(jnp.int32), w)  # not floats
    assert not _runs_kernel(x[:, :-8], w[:, :, :-8])  # K off the lanes
    assert not _runs_kernel(x, w[:, :-2])  # N not a multiple of 4


def test_the_engines_step_runs_the_experts_on_the_kernel():
    # The tiny Qwen3-MoE's ragged step (a decoding row beside a prompt chunk), lowered as its
    # engine on this CPU would (the "cpu" attention backend): its one routed layer's gate|up
    # and down products on the kernel.
    raw = tiny_qwen3_moe_config().to_dict()
    cfg = hf_config_to_model_config(raw, "float32", source="config.json")
    args, kwargs = ragged_step_inputs(cfg, RuntimeOptions(attention_backend="cpu"))
    text = mixed_step.lower(*args, **kwargs).as_text()
    assert text.count(GROUPED_PRODUCTS.name) == 2
