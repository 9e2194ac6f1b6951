"""Routed experts kept in blocks (etjax/model/quantized.py, weights="int8" and "stored"): the
grouped-products kernel reading them (cpp_kernels/grouped_products.cc with block_rows.h) and
the XLA path (pallas_kernels/grouped_products/xla.py) against float64 NumPy of the dequantized
blocks, for every block format; and a tiny Qwen3-MoE whose experts load quantized, its greedy
tokens on the engine those of the same model with its weights dequantized to float32."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType

import etjax
from cpp_kernels import cpu_kernels_available
from cpp_kernels.targets import GROUPED_PRODUCTS
from etjax.model.products import grouped_product, row_products
from etjax.model.quantized import QuantizedWeight, dequantize_weights, weight_formats
from etjax.model.weights import abstract_weights
from pallas_kernels.block_products.formats import INT8, Q4_0, Q4_1, Q4_K, Q6_K, Q8_0
from pallas_kernels.block_products.reference import dequantize_reference

needs_kernels = pytest.mark.skipif(not cpu_kernels_available(), reason="no C++ compiler")

# R rows; K: two blocks of 32 (four of Q6_K's 16); N: ten groups of 4 outputs, more than one
# unit's 32 (the first unit whole, so a group of over 32 rows takes the panel path); E experts.
ROWS, IN, OUT, EXPERTS = 48, 64, 40, 5
SIZES = {
    # 3 rows (one row block), none, 7 (pairs with AVX-512), 1, 36 (the panel): 48 rows.
    "every path": [3, 0, 7, 1, 36],
    "one row, 47 in no group": [0, 1, 0, 0, 0],
    "uneven, 10 in no group": [5, 2, 0, 8, 23],
    "no rows in any group": [0] * EXPERTS,
}
FORMATS = (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K, INT8)


def _experts(fmt, seed: int = 0) -> tuple[QuantizedWeight, np.ndarray]:
    """Random experts [E, N, K] in `fmt` (its arrays as the loaders hold them) and their
    float64 dequantization."""
    rng = np.random.default_rng(seed)
    n = EXPERTS * OUT
    if fmt.bits == 4:
        quants = rng.integers(0, 256, (n, IN // 2), dtype=np.uint8)
    else:
        low = -32 if fmt is Q6_K else -127  # Q6_K's values: -32..31
        quants = rng.integers(low, -low, (n, IN), dtype=np.int8)
    block = fmt.block_size(IN)
    dtype = np.dtype(fmt.scale_dtype)
    scales = (rng.random((n, IN // block)) * 0.1).astype(dtype)
    offsets = (rng.standard_normal((n, IN // block)) * 0.1).astype(dtype) if fmt.offsets else None
    stack = lambda a: None if a is None else jnp.asarray(a.reshape(EXPERTS, OUT, -1))  # noqa: E731
    w = QuantizedWeight(stack(quants), stack(scales), stack(offsets), fmt, (EXPERTS, OUT, IN))
    truth = dequantize_reference(quants, scales, offsets, block, fmt.bits)
    return w, truth.reshape(EXPERTS, OUT, IN)


def _reference(x, w, sizes):
    """float64: row r of group e times w[e].T; rows past the groups zero."""
    out, start = np.zeros((x.shape[0], w.shape[1])), 0
    for e, size in enumerate(sizes):
        out[start : start + size] = np.asarray(x[start : start + size], np.float64) @ w[e].T
        start += size
    return out


def _grouped(kernel: bool):
    # A new function each time, traced (at its first call) in the context: jax caches a trace
    # by function, not by the context it was traced in.
    product = jax.jit(lambda *args: grouped_product(*args))

    def run(*args):
        with row_products(kernel):
            return product(*args)

    return run, product


@needs_kernels
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_grouped_blocks_match_numpy(fmt):
    x = jnp.asarray(np.random.default_rng(1).standard_normal((ROWS, IN)), jnp.float32)
    w, truth = _experts(fmt)
    for kernel in (True, False):
        product, jitted = _grouped(kernel)
        sizes = jnp.asarray(SIZES["every path"], jnp.int32)
        with row_products(kernel):
            assert (GROUPED_PRODUCTS.name in jitted.lower(x, w, sizes).as_text()) == kernel
        for name, sizes in SIZES.items():
            got = np.asarray(product(x, w, jnp.asarray(sizes, jnp.int32)))
            want = _reference(x, truth, sizes)
            assert got.dtype == np.float32 and got.shape == (ROWS, OUT)
            # float32 sums of 64 products of magnitude up to ~13 (int8 values times 0.1):
            # a few ulps of their sum of |terms|, which is below 400.
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-4, err_msg=f"{name} {kernel}")
            assert not got[sum(sizes) :].any()  # rows in no group: zero


@needs_kernels
def test_a_rows_product_on_blocks_does_not_depend_on_the_rows_beside_it():
    # Bit for bit, up to 32 rows a group (block_products.cc): row 5, of expert 2's group of 7
    # (the pairs' path with AVX-512), and row 1, of expert 0's group of 3 (a row block), each
    # alone in a group of one.
    x = jnp.asarray(np.random.default_rng(2).standard_normal((ROWS, IN)), jnp.float32)
    w, _ = _experts(Q4_1, seed=3)
    product, jitted = _grouped(True)
    sizes = jnp.asarray([3, 0, 7, 1, 36], jnp.int32)
    with row_products(True):
        assert GROUPED_PRODUCTS.name in jitted.lower(x, w, sizes).as_text()
    together = np.asarray(product(x, w, jnp.asarray([3, 0, 7, 1, 36], jnp.int32)))
    # A bfloat16 model's rows: widened, the float32 sums rounded back.
    rows16 = x.astype(jnp.bfloat16)
    got = product(rows16, w, sizes)
    assert got.dtype == jnp.bfloat16
    want = product(rows16.astype(jnp.float32), w, sizes).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    for row, expert in ((5, 2), (1, 0)):
        sizes = jnp.asarray(np.eye(EXPERTS, dtype=np.int32)[expert])
        alone = np.asarray(product(x.at[0].set(x[row]), w, sizes))
        np.testing.assert_array_equal(alone[0], together[row])


@needs_kernels
def test_the_kernel_takes_only_the_blocks_shapes_it_reads():
    x = jnp.zeros((ROWS, IN), jnp.float32)
    w, _ = _experts(Q8_0)
    sizes = jnp.zeros((EXPERTS,), jnp.int32)

    def on_kernel(x, w):
        with row_products(True):
            text = jax.jit(lambda *a: grouped_product(*a)).lower(x, w, sizes).as_text()
        return GROUPED_PRODUCTS.name in text

    assert on_kernel(x, w)
    assert on_kernel(x.astype(jnp.bfloat16), w)  # a bfloat16 model's rows, widened
    cut = w.replace(quants=w.quants[:, :-2], scales=w.scales[:, :-2], shape=(EXPERTS, 38, IN))
    assert not on_kernel(x, cut)  # N not a multiple of 4


@pytest.fixture(scope="module")
def tiny_qwen3_moe(tmp_path_factory, hf_smollm2_tokenizer):
    """The tiny Qwen3-MoE of test_moe.py written as a Hugging Face folder and as a qwen3moe
    GGUF of Q4_0 matrices (every layer routed): (folder, GGUF path)."""
    from transformers import AutoModelForCausalLM

    from tests.gguf_builder import write_moe_gguf
    from tests.test_moe import tiny_qwen3_moe_config
    from tests.test_qwen3 import save_tiny_model

    directory = tmp_path_factory.mktemp("tiny-moe-blocks")
    config = tiny_qwen3_moe_config(norm_topk_prob=True, mlp_only_layers=[])
    save_tiny_model(config, directory, hf_smollm2_tokenizer, seed=17)
    path = directory / "tiny-q4_0.gguf"
    hf = AutoModelForCausalLM.from_pretrained(directory)
    write_moe_gguf(hf, path, "qwen3moe", GGMLQuantizationType.Q4_0)
    return directory, path


def _stored_model(directory, path):
    # The GGUF's weights (it has no tokenizer) under the folder's tokenizer and config: the
    # same but for rms_norm_eps rounded to float32 (test_moe.py), so both tests' float
    # references share their step programs.
    from etjax.loaders.gguf_weights import (
        gguf_model_config,
        gguf_tensors,
        load_gguf_weights,
        open_gguf,
    )

    reader = open_gguf(path)
    cfg = gguf_model_config(reader, "float32")
    model = etjax.load_model(directory, dtype="float32")
    assert cfg == dataclasses.replace(model.config, rms_norm_eps=cfg.rms_norm_eps)
    stored = load_gguf_weights(gguf_tensors(reader), cfg, "stored")
    floats = load_gguf_weights(gguf_tensors(reader), cfg, "float32")
    return dataclasses.replace(model, weights=stored), floats


@pytest.mark.parametrize("weights", ["int8", "stored"])
def test_moe_experts_kept_quantized_greedy_equal_their_dequantization(weights, tiny_qwen3_moe):
    directory, path = tiny_qwen3_moe
    if weights == "int8":
        model = etjax.load_model(directory, weights="int8")
        # What a planner counts for weights="int8" is what the load holds.
        planned = abstract_weights(model.config, "int8")
        assert jax.tree.structure(planned) == jax.tree.structure(model.weights)
    else:
        model, floats = _stored_model(directory, path)
        # The blocks are the file's values: the gguf package's dequantization, each expert's
        # slice of the stacked tensors.
        for ours, file in zip(model.weights.layers, floats.layers, strict=True):
            for name in ("experts_gate_up", "experts_down"):
                want = np.asarray(getattr(file, name))
                np.testing.assert_array_equal(np.asarray(getattr(ours, name).dequantize()), want)
    layer = model.weights.layers[0]
    held = {"int8": "int8", "stored": "q4_0"}[weights]
    for name, shape in (("experts_gate_up", (8, 64, 64)), ("experts_down", (8, 64, 32))):
        expert = getattr(layer, name)
        assert isinstance(expert, QuantizedWeight) and expert.shape == shape
        assert expert.format.name == held and expert.quants.shape[0] == 8
    assert layer.router.dtype == np.float32  # the router stays float
    assert held in set(weight_formats(model.weights).values())
    reference = dataclasses.replace(model, weights=dequantize_weights(model.weights))
    # Greedy tokens through the engine (its CPU step programs: the kernels; XLA's path is
    # test_grouped_blocks_match_numpy's, format by format).
    rng = np.random.default_rng(1)
    prompts = [model.tokenizer.decode(rng.integers(3, 500, size=n).tolist()) for n in (5, 21)]

    def greedy(m):
        results = etjax.decode(prompts, model=m, max_new_tokens=12, ignore_eos=True)
        return [r.token_ids for r in results]

    assert greedy(model) == greedy(reference)
