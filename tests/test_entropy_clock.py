"""Entropic time and the cost model on hand-computed sequences."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

import etjax
from etjax.engine_build import RequestSettings, RuntimeOptions, generate_ids
from etjax.entropy.cost import CostModel
from etjax.entropy.state import advance_tau, initial_entropy_state


def test_tau_counts_only_entropy_reductions():
    entropies = [2.0, 1.5, 1.7, 0.2, 0.2, 1.0]  # drops: -, 0.5, 0, 1.5, 0, 0
    zeros = jnp.zeros(1)
    state = initial_entropy_state(zeros, zeros)
    taus = []
    for h in entropies:
        state = advance_tau(state, jnp.asarray([h]), jnp.asarray([True]))
        taus.append(float(state.tau[0]))
    np.testing.assert_allclose(taus, [0.0, 0.5, 0.5, 2.0, 2.0, 2.0], atol=1e-6)
    # An inactive row's clock does not move and its memory of H is kept.
    frozen = advance_tau(state, jnp.asarray([0.0]), jnp.asarray([False]))
    assert float(frozen.tau[0]) == pytest.approx(2.0)
    assert float(frozen.prev_entropy[0]) == pytest.approx(1.0)


@pytest.fixture(scope="module")
def tiny(tiny_hf_dir):
    return etjax.load_model(tiny_hf_dir("llama"))


def test_cost_constants_follow_the_stated_formula(tiny, tiny_hf_dir):
    from transformers import AutoModelForCausalLM

    cfg = tiny.config  # hidden 64, intermediate 128, 2 layers, 4 heads, 2 KV heads, hd 16
    cost = CostModel.for_model(cfg, page_size=4)
    per_layer = 64 * (4 + 2 * 2) * 16 + 4 * 16 * 64 + 3 * 64 * 128
    assert cost.matmul_flops_per_token == 2 * (2 * per_layer + 64 * 49152)
    assert cost.attention_flops_per_key == 4 * 2 * 4 * 16
    assert cost.kv_bytes_per_key == 2 * 2 * 2 * 16 * 4
    # Weight bytes: transformers' own parameter count, 4 bytes each in float32.
    hf = AutoModelForCausalLM.from_pretrained(tiny_hf_dir("llama"))
    assert cost.weight_bytes == 4 * hf.num_parameters()


def test_an_engine_counts_the_bytes_its_int8_weights_hold(tiny_hf_dir):
    # Weights kept in int8 are read as int8 each pass: an engine's cost model counts what the
    # load holds, by hand from transformers' parameters (a matrix: a byte a weight and a
    # float32 scale an output row; a norm: float32).
    from transformers import AutoModelForCausalLM

    from etjax.engine.device import DeviceBackend

    model = etjax.load_model(tiny_hf_dir("llama"), weights="int8")
    hf = AutoModelForCausalLM.from_pretrained(tiny_hf_dir("llama"))
    held = sum(
        p.numel() + 4 * p.shape[0] if p.ndim == 2 else 4 * p.numel() for p in hf.parameters()
    )
    options = RuntimeOptions(max_batch_size=1, page_size=4)
    backend = DeviceBackend(model.weights, model.config, (), options, 8, compile_only=True)
    assert backend.cost.weight_bytes == held < 4 * hf.num_parameters() / 3


def test_cost_trace_of_a_single_sequence(tiny):
    cost = CostModel.for_model(tiny.config, page_size=4)
    w, kv = cost.weight_bytes, cost.kv_bytes_per_key

    def keys(positions: int) -> int:  # whole pages of 4
        return math.ceil(positions / 4) * 4

    prompt = [11, 12, 13, 14, 15]
    (out,) = generate_ids(
        tiny.weights,
        tiny.config,
        tiny.tokenizer,
        [prompt],
        [RequestSettings(max_new_tokens=4, ignore_eos=True)],
        RuntimeOptions(page_size=4),
    )
    prefill = w + kv * sum(keys(i) for i in range(1, 6))
    # Each step samples a token, then runs the model on it, unless it was the last one.
    forwards = [w + kv * keys(n) for n in (6, 7, 8)]
    expected = [prefill + sum(forwards[:k]) for k in (1, 2, 3)] + [prefill + sum(forwards)]
    np.testing.assert_allclose(out.cost_bytes, expected, rtol=1e-6)
    flops = cost.matmul_flops_per_token
    attn = cost.attention_flops_per_key
    prefill_flops = 5 * flops + attn * sum(keys(i) for i in range(1, 6))
    np.testing.assert_allclose(
        out.cost_flops[-1], prefill_flops + 3 * flops + attn * (8 + 8 + 8), rtol=1e-6
    )


def test_weights_are_shared_by_the_rows_of_a_step(tiny):
    cost = CostModel.for_model(tiny.config, page_size=4)
    flops, nbytes = cost.token_cost(jnp.asarray([8.0, 8.0, 8.0]), jnp.asarray([True, True, False]))
    np.testing.assert_allclose(
        np.asarray(nbytes), [cost.weight_bytes / 2 + 8 * cost.kv_bytes_per_key] * 2 + [0.0]
    )
    assert float(flops[2]) == 0.0


def test_result_tau_is_the_sum_of_entropy_drops(tiny):
    (result,) = etjax.decode("The river", model=tiny, max_new_tokens=16, ignore_eos=True)
    h = np.asarray(result.entropy)
    expected = np.concatenate([[0.0], np.cumsum(np.maximum(h[:-1] - h[1:], 0.0))])
    np.testing.assert_allclose(result.tau, expected, rtol=1e-5, atol=1e-5)
