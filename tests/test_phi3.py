"""Phi-3 against transformers, on tiny random models written by the test.

The model has 3 layers with grouped-query attention, an untied head, the fused q|k|v and
gate|up projections of Phi-3's files, and Phi-3-mini's window on every layer (8 positions
here), so most positions see only part of the context. A second config of the same weights
carries longrope scaling, which etjax serves up to its original context with the short
factors and transformers' temperature. Tolerance as in test_model_parity.py.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import jax
import numpy as np
import pytest
import torch

import etjax
from etjax.errors import ModelLoadError
from etjax.loaders.hf_config import hf_config_to_model_config
from tests.conftest import TINY_VOCAB, relative_error
from tests.greedy_reference import greedy_choices
from tests.model_runner import full_logits
from tests.test_qwen3 import assert_gguf_reads_as_hf_dir, gguf_of, save_tiny_model

TOLERANCE = 1e-4
WINDOW = 8
NEW_TOKENS = 32
HEAD_DIM = 16


def tiny_phi3_config(**overrides):
    """transformers' own Phi-3 config of the tiny test model."""
    from transformers import Phi3Config

    fields = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        original_max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        sliding_window=WINDOW,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return Phi3Config(**{**fields, **overrides})


@pytest.fixture(scope="module")
def tiny_phi3_dir(tmp_path_factory, hf_smollm2_tokenizer):
    directory = tmp_path_factory.mktemp("tiny-phi3")
    return save_tiny_model(tiny_phi3_config(), directory, hf_smollm2_tokenizer, seed=7)


@pytest.fixture(scope="module")
def tiny_phi3(tiny_phi3_dir):
    return etjax.load_model(tiny_phi3_dir, dtype="float32")


@pytest.fixture(scope="module")
def hf_tiny_phi3(tiny_phi3_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_phi3_dir, dtype=torch.float32).eval()


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids, dtype=torch.long)).logits.numpy()


def test_tiny_phi3_logits_match_transformers(tiny_phi3, hf_tiny_phi3):
    cfg = tiny_phi3.config
    assert cfg.architecture == "phi3" and not cfg.tie_word_embeddings
    assert cfg.local_layers == (0, 1, 2) and cfg.sliding_window == WINDOW
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(2, 64), dtype=np.int32)
    reference = _logits(hf_tiny_phi3, ids)
    assert relative_error(full_logits(tiny_phi3.weights, cfg, ids, 4), reference) < TOLERANCE


def test_tiny_phi3_greedy_decode_matches_transformers(tiny_phi3, hf_tiny_phi3):
    # Through `decode()` (the engine: ragged prefill, cached decode steps in bursts), three
    # prompts of different lengths together, 32 new tokens each, far past the window.
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, TINY_VOCAB, size=n).tolist() for n in (5, 21, 40)]
    texts = [tiny_phi3.tokenizer.decode(p) for p in prompts]
    results = etjax.decode(
        texts, model=tiny_phi3, max_new_tokens=NEW_TOKENS, ignore_eos=True, page_size=4
    )
    for result in results:
        # transformers' greedy search, in one teacher-forced pass (tests/greedy_reference.py).
        expected = greedy_choices(hf_tiny_phi3, result.prompt_token_ids, result.token_ids)
        assert len(result.token_ids) == NEW_TOKENS and result.token_ids == expected


def test_tiny_phi3_gguf_loads_the_same_model(tiny_phi3, hf_tiny_phi3, tmp_path):
    assert_gguf_reads_as_hf_dir(tiny_phi3, hf_tiny_phi3, "phi3", tmp_path)


def _longrope(rope_type: str = "longrope") -> dict:
    rng = np.random.default_rng(4)
    return {
        "rope_type": rope_type,
        "rope_theta": 10000.0,
        "short_factor": (1 + 3 * rng.random(HEAD_DIM // 2)).tolist(),
        "long_factor": (1 + 30 * rng.random(HEAD_DIM // 2)).tolist(),
        "original_max_position_embeddings": 64,
    }


def test_tiny_phi3_longrope_matches_transformers_within_the_original_context(
    tiny_phi3_dir, tmp_path
):
    # A 512-position model trained at 64: factor 8, temperature sqrt(1 + ln 8 / ln 64). etjax
    # serves the 64 positions where transformers uses the short factors, and says so.
    from transformers import AutoModelForCausalLM

    directory = tmp_path / "longrope"
    shutil.copytree(tiny_phi3_dir, directory)
    config = json.loads((directory / "config.json").read_text())
    config["rope_parameters"] = _longrope("su")  # the older name, read as longrope
    config["original_max_position_embeddings"] = 64
    (directory / "config.json").write_text(json.dumps(config))
    model = etjax.load_model(directory, dtype="float32")
    scaling = model.config.rope_scaling
    assert scaling.rope_type == "longrope" and model.config.max_position_embeddings == 64
    assert scaling.attention_factor == pytest.approx((1 + np.log(8) / np.log(64)) ** 0.5)
    ids = np.random.default_rng(3).integers(0, TINY_VOCAB, size=(1, 64), dtype=np.int32)
    reference_model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    reference = _logits(reference_model, ids)
    assert relative_error(full_logits(model.weights, model.config, ids, 4), reference) < TOLERANCE
    unscaled = dataclasses.replace(model.config, rope_scaling=None)
    assert relative_error(full_logits(model.weights, unscaled, ids, 4), reference) > 1e-2

    # As llama.cpp's converter writes it: the factors as tensors rope_factors_short/long
    # (float32), the temperature as phi3.rope.scaling.attn_factor. The same config but for
    # the factors' rounding, the same weights, transformers' logits.
    cfg, weights = gguf_of(reference_model, "phi3", tmp_path)
    short = tuple(float(f) for f in np.float32(scaling.frequency_factors))
    assert cfg == dataclasses.replace(
        model.config,
        rms_norm_eps=float(np.float32(model.config.rms_norm_eps)),
        rope_scaling=dataclasses.replace(scaling, frequency_factors=short),
    )
    jax.tree.map(np.testing.assert_array_equal, weights, model.weights)
    assert relative_error(full_logits(weights, cfg, ids, 4), reference) < TOLERANCE


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}}, "partial_rotary"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "'dynamic'"),
        ({"rope_parameters": {**_longrope(), "short_factor": [1.0] * 3}}, "short_factor"),
        ({"rope_parameters": {"rope_type": "longrope"}}, "short_factor"),
        ({"hidden_act": "gelu_new"}, "hidden_act"),
    ],
)
def test_unsupported_phi3_config_is_refused_by_name(change, named):
    raw = {**tiny_phi3_config().to_dict(), **change}
    with pytest.raises(ModelLoadError, match=named):
        hf_config_to_model_config(raw, "float32", source="config.json")
