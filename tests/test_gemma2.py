"""Gemma 2 against transformers, on a tiny random model written by the test.

The model has 4 layers with grouped-query attention, a tied head, random norm scales, a
query scale that is not head_dim ** -0.5, a window of 8 positions on its first and third
layers, and soft caps small enough to bite: attention scores capped at 2, logits at 5, so a
missing cap, window or scale shows in the logits. Tolerance as in test_model_parity.py.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import etjax
from etjax.errors import ModelLoadError
from etjax.loaders.hf_config import hf_config_to_model_config
from tests.conftest import TINY_VOCAB, relative_error
from tests.greedy_reference import greedy_choices
from tests.model_runner import full_logits
from tests.test_qwen3 import assert_gguf_reads_as_hf_dir, save_tiny_model

TOLERANCE = 1e-4
WINDOW = 8
NEW_TOKENS = 32


def tiny_gemma2_config(**overrides):
    """transformers' own Gemma 2 config of the tiny test model."""
    from transformers import Gemma2Config

    fields = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        sliding_window=WINDOW,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=5.0,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return Gemma2Config(**{**fields, **overrides})


@pytest.fixture(scope="module")
def tiny_gemma2_dir(tmp_path_factory, hf_smollm2_tokenizer):
    directory = tmp_path_factory.mktemp("tiny-gemma2")
    return save_tiny_model(tiny_gemma2_config(), directory, hf_smollm2_tokenizer, seed=9)


@pytest.fixture(scope="module")
def tiny_gemma2(tiny_gemma2_dir):
    return etjax.load_model(tiny_gemma2_dir, dtype="float32")


@pytest.fixture(scope="module")
def hf_tiny_gemma2(tiny_gemma2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_gemma2_dir, dtype=torch.float32).eval()


def test_tiny_gemma2_logits_match_transformers(tiny_gemma2, hf_tiny_gemma2):
    cfg = tiny_gemma2.config
    assert cfg.architecture == "gemma2" and cfg.tie_word_embeddings
    assert cfg.local_layers == (0, 2) and cfg.sliding_window == WINDOW
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (2.0, 5.0)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(2, 64), dtype=np.int32)
    with torch.no_grad():
        reference = hf_tiny_gemma2(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    weights = tiny_gemma2.weights
    assert relative_error(full_logits(weights, cfg, ids, page_size=4), reference) < TOLERANCE

    # Each cap shows: without the attention cap the logits are far off; and the logits reach
    # 0.6 of their cap of 5, where an uncapped logit (5 atanh(0.6) = 3.47 for a capped 3)
    # would differ by 0.47, far beyond the tolerance: a missing final cap would fail above.
    uncapped = dataclasses.replace(cfg, attn_logit_softcapping=0.0)
    assert relative_error(full_logits(weights, uncapped, ids, 4), reference) > 1e-2
    assert np.abs(reference).max() > 0.6 * cfg.final_logit_softcapping


def test_tiny_gemma2_greedy_decode_matches_transformers(tiny_gemma2, hf_tiny_gemma2):
    # Through `decode()` (the engine: ragged prefill, cached decode steps in bursts), three
    # prompts of different lengths together, 32 new tokens each, far past the window.
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, TINY_VOCAB, size=n).tolist() for n in (5, 21, 40)]
    texts = [tiny_gemma2.tokenizer.decode(p) for p in prompts]
    results = etjax.decode(
        texts, model=tiny_gemma2, max_new_tokens=NEW_TOKENS, ignore_eos=True, page_size=4
    )
    for result in results:
        # transformers' greedy search, in one teacher-forced pass (tests/greedy_reference.py).
        expected = greedy_choices(hf_tiny_gemma2, result.prompt_token_ids, result.token_ids)
        assert len(result.token_ids) == NEW_TOKENS and result.token_ids == expected


def test_tiny_gemma2_gguf_loads_the_same_model(tiny_gemma2, hf_tiny_gemma2, tmp_path):
    # llama.cpp stores no query scale: it takes head_dim (hidden / heads for the 27B model).
    assert_gguf_reads_as_hf_dir(
        tiny_gemma2, hf_tiny_gemma2, "gemma2", tmp_path, query_pre_attn_scalar=16.0
    )


def test_pruning_a_soft_capped_model_is_refused_by_name(tiny_gemma2):
    # The block-sparse kernels do not cap scores: pruning would silently change the model.
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        etjax.decode("x", model=tiny_gemma2, max_new_tokens=2, pruning=True)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"hidden_activation": "relu"}, "hidden_activation"),
        ({"attention_bias": True}, "attention_bias"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "'linear'"),
        ({"layer_types": ["sliding_attention"] * 3}, "layer_types"),
        ({"tie_word_embeddings": False}, "tie_word_embeddings"),
    ],
)
def test_unsupported_gemma2_config_is_refused_by_name(change, named):
    raw = {**tiny_gemma2_config().to_dict(), **change}
    with pytest.raises(ModelLoadError, match=named):
        hf_config_to_model_config(raw, "float32", source="config.json")
