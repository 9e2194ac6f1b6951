"""Forward equivalence of the paged cache: incremental decoding must equal one full pass."""

from __future__ import annotations

import chex
import numpy as np
import pytest

import etjax
from etjax.engine_build import RequestSettings, RuntimeOptions, generate_ids
from etjax.sampling import SamplerSettings
from tests.model_runner import full_logits

# Every reference pass runs one padded shape (the longest sequence here is 49 tokens), so the
# forward program and its eager LM head compile once for the module; tokens after a position
# never change its logits (causal attention), so the end padding reads as nothing.
REFERENCE_LEN = 64
# The engine options of every test but the one that sets its own: their step programs compile
# once per page size for the module.
ENGINE = dict(steps_per_sync=5, prefill_chunk=8)


def _reference_logits(tiny, sequence: list[int]) -> np.ndarray:
    """float32 logits [len(sequence), V] of one full pass over `sequence`."""
    ids = np.zeros((1, REFERENCE_LEN), np.int32)
    ids[0, : len(sequence)] = sequence
    return full_logits(tiny.weights, tiny.config, ids)[0, : len(sequence)]


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    # In float64, apart from etjax's own entropy code: the independent truth.
    z = logits.astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def _entropy(logits: np.ndarray) -> np.ndarray:
    log_p = _log_softmax(logits)
    return -(np.exp(log_p) * log_p).sum(-1)


@pytest.fixture(scope="module")
def tiny(tiny_hf_dir):
    directory = tiny_hf_dir("llama")
    return etjax.load_model(directory)


@pytest.mark.parametrize("page_size,prompt_len", [(4, 3), (4, 9), (8, 16), (16, 37)])
def test_cached_steps_equal_full_sequence_logits(tiny, page_size, prompt_len):
    """Greedy-generate with the paged cache, then re-run prompt+output in one pass.

    The entropy trace of each generated token is a function of the logits it was drawn from, so
    comparing it to the entropy of the full pass's logits at the same positions checks every
    cached step; the greedy tokens must also equal the full pass's argmax.
    """
    rng = np.random.default_rng(prompt_len)
    prompt = rng.integers(3, tiny.config.vocab_size, size=prompt_len).tolist()
    settings = RequestSettings(max_new_tokens=12, ignore_eos=True)
    options = RuntimeOptions(page_size=page_size, **ENGINE)
    (out,) = generate_ids(tiny.weights, tiny.config, tiny.tokenizer, [prompt], [settings], options)
    assert len(out.token_ids) == 12
    logits = _reference_logits(tiny, prompt + out.token_ids)
    predicting = logits[prompt_len - 1 : prompt_len - 1 + 12]
    np.testing.assert_array_equal(predicting.argmax(-1), out.token_ids)
    np.testing.assert_allclose(out.entropy, _entropy(predicting), rtol=1e-4, atol=1e-5)
    expected_logprob = _log_softmax(predicting)[np.arange(12), out.token_ids]
    np.testing.assert_allclose(out.logprob, expected_logprob, rtol=1e-4, atol=1e-5)


def test_chunked_prefill_equals_single_pass(tiny):
    # A 40-token prompt prefilled in chunks of 8 must leave the same next-token distribution as
    # one pass: the first sampled token and its entropy are compared with the full logits.
    rng = np.random.default_rng(7)
    prompt = rng.integers(3, tiny.config.vocab_size, size=40).tolist()
    options = RuntimeOptions(page_size=4, **ENGINE)
    (out,) = generate_ids(
        tiny.weights,
        tiny.config,
        tiny.tokenizer,
        [prompt],
        [RequestSettings(max_new_tokens=1)],
        options,
    )
    logits = _reference_logits(tiny, prompt)[-1]
    assert out.token_ids == [int(logits.argmax())]
    np.testing.assert_allclose(out.entropy[0], _entropy(logits), rtol=1e-5)


def test_sequence_alone_equals_batched_with_other_lengths(tiny):
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, tiny.config.vocab_size, size=n).tolist() for n in (5, 17, 2, 33)]
    settings = [RequestSettings(max_new_tokens=10, ignore_eos=True)] * 4
    options = RuntimeOptions(page_size=8, **ENGINE)
    batched = generate_ids(tiny.weights, tiny.config, tiny.tokenizer, prompts, settings, options)
    for prompt, together in zip(prompts, batched, strict=True):
        (alone,) = generate_ids(
            tiny.weights, tiny.config, tiny.tokenizer, [prompt], settings[:1], options
        )
        assert alone.token_ids == together.token_ids
        # Alone, a row's products have one row; batched, four: XLA:CPU runs them with other
        # kernels, which sum in another order, so traces agree to float32 rounding of the
        # logits (3.8e-6 on a tau of 0.155 with [out, in] weights), not bit for bit.
        chex.assert_trees_all_close(
            (alone.entropy, alone.logprob, alone.tau),
            (together.entropy, together.logprob, together.tau),
            rtol=1e-5,
            atol=1e-5,
        )


def test_sampled_sequence_is_the_same_alone_and_batched(tiny):
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, tiny.config.vocab_size, size=n).tolist() for n in (6, 11, 23)]
    settings = [
        RequestSettings(max_new_tokens=8, sampler=SamplerSettings(temperature=1.0, seed=s))
        for s in (5, 6, 7)
    ]
    options = RuntimeOptions(page_size=8, **ENGINE)
    batched = generate_ids(tiny.weights, tiny.config, tiny.tokenizer, prompts, settings, options)
    alone = generate_ids(
        tiny.weights, tiny.config, tiny.tokenizer, prompts[1:2], settings[1:2], options
    )
    assert alone[0].token_ids == batched[1].token_ids
    assert batched[0].token_ids != batched[2].token_ids  # different seeds, different draws


def test_prompts_prefilled_beside_decoding_rows_match_full_passes(tiny):
    # Two short prompts decode while a third is prefilled in chunks of 8 beside them in the
    # same ragged steps; its 17 tokens end in a one-token chunk next to a full decode batch.
    # Every greedy continuation must equal the argmax of one full pass over prompt + output.
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, tiny.config.vocab_size, size=n).tolist() for n in (5, 6, 17)]
    settings = [RequestSettings(max_new_tokens=10, ignore_eos=True)] * 3
    options = RuntimeOptions(
        page_size=4,
        max_batch_size=2,
        max_resident=3,
        prefill_chunk=8,
        max_prefill_rows=1,
        token_budget=10,
        steps_per_sync=3,
    )
    outs = generate_ids(tiny.weights, tiny.config, tiny.tokenizer, prompts, settings, options)
    for prompt, out in zip(prompts, outs, strict=True):
        logits = _reference_logits(tiny, prompt + out.token_ids)
        predicting = logits[len(prompt) - 1 : len(prompt) - 1 + 10]
        np.testing.assert_array_equal(predicting.argmax(-1), out.token_ids)


def test_the_tpu_write_puts_the_same_values_where_the_cpu_write_does():
    # Two spellings of one scatter (etjax/cache/kv_cache.py): the head-indexed one a TPU
    # compiles in place. Checked against numpy: token t's heads at (pages[t], slot[t]).
    import jax.numpy as jnp

    from etjax.cache.kv_cache import scatter_head_indexed, scatter_head_slice

    rng = np.random.default_rng(0)
    store = rng.standard_normal((6, 3, 4, 8)).astype(np.float32)
    new = rng.standard_normal((5, 3, 8)).astype(np.float32)
    pages, slot = np.array([1, 4, 4, 2, 5]), np.array([0, 1, 3, 3, 2])
    expected = store.copy()
    for t in range(5):
        expected[pages[t], :, slot[t]] = new[t]
    for write in (scatter_head_slice, scatter_head_indexed):
        got = write(jnp.asarray(store), jnp.asarray(new), jnp.asarray(pages), jnp.asarray(slot))
        np.testing.assert_array_equal(np.asarray(got), expected)
