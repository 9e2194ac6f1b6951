"""16-bit KV caches (`RuntimeOptions.kv_dtype` bfloat16 and float16): their only difference
from float32 is that keys and values are rounded when stored.

The truth is transformers in float32 with its keys (after RoPE, as the cache holds them) and
values rounded to the cache's dtype by hooks: everything else (projections, softmax,
accumulation) computes in float32 on both sides, so the engine's outputs with a 16-bit cache
must match that reference as closely as float32 ones match the plain one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import etjax
from etjax.cache.kv_cache import init_kv_cache, kv_cache_bytes, page_pool, write_kv
from etjax.engine_build import RequestSettings, RuntimeOptions, generate_ids
from etjax.entropy.estimators import exact_entropy
from etjax.errors import FieldError

PROMPT_LEN, NEW = 21, 10
# As a step runs it, one program per pool: eagerly, each of its operations compiles alone.
_write_kv = jax.jit(write_kv)


@pytest.fixture(scope="module")
def tiny(tiny_hf_dir):
    return etjax.load_model(tiny_hf_dir("llama"))


def _reference_logits(directory, ids: np.ndarray, dtype: str) -> np.ndarray:
    """transformers' float32 logits [S, V] with keys and values rounded to `dtype`."""
    from transformers import AutoModelForCausalLM
    from transformers.models.llama import modeling_llama

    def _rounded(t: torch.Tensor) -> torch.Tensor:
        return t.to(getattr(torch, dtype)).to(torch.float32)

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    for layer in model.model.layers:
        layer.self_attn.v_proj.register_forward_hook(lambda _m, _i, out: _rounded(out))
    rotate = modeling_llama.apply_rotary_pos_emb

    def rotate_then_round(q, k, cos, sin, *args, **kwargs):
        q, k = rotate(q, k, cos, sin, *args, **kwargs)
        return q, _rounded(k)

    modeling_llama.apply_rotary_pos_emb = rotate_then_round
    try:
        with torch.no_grad():
            return model(torch.tensor(ids[None], dtype=torch.long)).logits[0].numpy()
    finally:
        modeling_llama.apply_rotary_pos_emb = rotate


# float16 through the engine; bfloat16 takes the same path (the kernels read any dtype and
# compute in float32), and what it stores is checked below without compiling an engine again.
@pytest.mark.parametrize("dtype", ["float16"])
def test_16_bit_cache_matches_transformers_with_rounded_keys_and_values(tiny_hf_dir, tiny, dtype):
    directory = tiny_hf_dir("llama")
    prompt = np.random.default_rng(3).integers(3, tiny.config.vocab_size, PROMPT_LEN).tolist()
    # Chunked prefill, then decode bursts: both read keys the engine stored in 16 bits.
    options = RuntimeOptions(page_size=4, steps_per_sync=4, prefill_chunk=8, kv_dtype=dtype)
    settings = RequestSettings(max_new_tokens=NEW, ignore_eos=True)
    (out,) = generate_ids(tiny.weights, tiny.config, tiny.tokenizer, [prompt], [settings], options)

    logits = _reference_logits(directory, np.array(prompt + out.token_ids), dtype)
    predicting = logits[PROMPT_LEN - 1 : PROMPT_LEN - 1 + NEW]
    np.testing.assert_array_equal(predicting.argmax(-1), out.token_ids)
    np.testing.assert_allclose(out.entropy, exact_entropy(predicting), rtol=1e-4, atol=1e-5)
    log_softmax = predicting - np.log(np.exp(predicting).sum(-1, keepdims=True))
    expected = log_softmax[np.arange(NEW), out.token_ids]
    np.testing.assert_allclose(out.logprob, expected, rtol=1e-4, atol=1e-5)


def test_bfloat16_cache_takes_half_the_bytes(tiny):
    cfg = tiny.config
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
    assert kv_cache_bytes(cfg, 10, 4) == 10 * 4 * per_token * 4  # the model's float32
    assert kv_cache_bytes(cfg, 10, 4, "bfloat16") == 10 * 4 * per_token * 2


def test_bfloat16_cache_stores_rounded_keys_and_their_bounds(tiny):
    cfg = tiny.config
    pool = page_pool(init_kv_cache(cfg, 4, 4, dtype="bfloat16"))
    keys = jnp.asarray(np.random.default_rng(0).normal(size=(3, cfg.num_kv_heads, cfg.head_dim)))
    keys = keys.astype(jnp.float32)
    pool = _write_kv(pool, keys, 2 * keys, jnp.asarray([1, 1, 2]), jnp.asarray([0, 1, 4]))
    rounded = np.asarray(keys.astype(jnp.bfloat16).astype(jnp.float32))
    assert pool.k.dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(pool.k[1, :, :2].astype(jnp.float32)).swapaxes(0, 1), rounded[:2]
    )
    np.testing.assert_array_equal(np.asarray(pool.v[2, :, 0].astype(jnp.float32)), 2 * rounded[2])
    np.testing.assert_array_equal(np.asarray(pool.k_max[1]), rounded[:2].max(axis=0))


def test_float16_cache_saturates_instead_of_overflowing(tiny):
    cfg = tiny.config
    pool = page_pool(init_kv_cache(cfg, 4, 4, dtype="float16"))
    big = jnp.full((1, cfg.num_kv_heads, cfg.head_dim), 1e6, jnp.float32)
    pool = _write_kv(pool, big, -big, jnp.asarray([1]), jnp.asarray([0]))
    assert float(pool.k[1, 0, 0, 0]) == 65504.0 and float(pool.v[1, 0, 0, 0]) == -65504.0
    assert float(pool.k_max[1, 0, 0]) == 65504.0  # the bounds are of what is stored


@pytest.mark.parametrize("value", ["float64", "bf16", None])
def test_unknown_kv_dtype_is_refused_by_name(value):
    with pytest.raises(FieldError, match="kv_dtype"):
        RuntimeOptions(kv_dtype=value)


@pytest.mark.parametrize(
    ("kv_dtype", "model_dtype", "platform", "stored"),
    [
        ("auto", "bfloat16", "cpu", "float16"),  # a bfloat16 pool is rewritten by every write
        ("auto", "bfloat16", "tpu", None),
        ("auto", "float32", "cpu", None),
        ("model", "bfloat16", "cpu", None),
        ("bfloat16", "float32", "cpu", "bfloat16"),
    ],
)
def test_auto_kv_dtype_avoids_bfloat16_pools_on_a_cpu(kv_dtype, model_dtype, platform, stored):
    options = RuntimeOptions(kv_dtype=kv_dtype)
    assert options.kv_cache_dtype(model_dtype, platform) == stored
