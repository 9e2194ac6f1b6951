"""A KV pool handed from one `decode()` engine to the next (etjax/cache/spare_pool.py): the
next call makes no pool, and its outputs are those of a freshly zeroed pool bit for bit,
though the pages it reuses hold another prompt's keys and values."""

from __future__ import annotations

import dataclasses
import gc

import jax
import numpy as np

import etjax
import etjax.engine.device as device
from etjax.cache import spare_pool
from etjax.engine_build import RequestSettings, RuntimeOptions, generate_ids

# tests/test_kv_cache.py's engine on the same tiny model (a pool of 256 pages, as decode()
# sizes one for small work): its programs, compiled once in the suite's process.
OPTIONS = RuntimeOptions(page_size=8, steps_per_sync=5, prefill_chunk=8)
SETTINGS = [RequestSettings(max_new_tokens=12, ignore_eos=True)]


def _run(model, prompt: list[int], options: RuntimeOptions = OPTIONS):
    (out,) = generate_ids(model.weights, model.config, model.tokenizer, [prompt], SETTINGS, options)
    return out.token_ids, np.asarray(out.logprob), np.asarray(out.entropy)


def test_the_next_engine_takes_the_pool_and_decodes_as_on_a_zeroed_one(tiny_hf_dir, monkeypatch):
    model = etjax.load_model(tiny_hf_dir("llama"))
    made = []  # the pools made (not the shapes `take` traces to compare with)
    real_init = device.init_kv_cache

    def counted_init(*args):
        pool = real_init(*args)
        if not isinstance(pool.k, jax.core.Tracer):
            made.append(args)
        return pool

    monkeypatch.setattr(device, "init_kv_cache", counted_init)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, model.config.vocab_size, size=n).tolist() for n in (60, 7)]

    # The truth: each prompt on a pool just made (zeros, every bound reset).
    fresh = []
    for prompt in prompts:
        spare_pool._spare = None
        fresh.append(_run(model, prompt))
    assert len(made) == 2
    # The long prompt fills pages the short one's engine then reuses, unzeroed.
    reused = [_run(model, prompt) for prompt in prompts]
    assert len(made) == 2  # each took the spare the engine before it left
    for want, got in zip(fresh, reused, strict=True):
        assert got[0] == want[0]
        np.testing.assert_array_equal(got[1], want[1])
        np.testing.assert_array_equal(got[2], want[2])
    # A pool of other shapes is made anew, and the spare goes with the weights.
    _run(model, prompts[1], dataclasses.replace(OPTIONS, num_pages=128))
    assert len(made) == 3
    assert spare_pool._spare[0]() is model.weights
    del model
    gc.collect()
    assert spare_pool._spare is None
