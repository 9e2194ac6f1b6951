"""Qwen3 (dense) against transformers, on a tiny random model written by the test.

The model has 4 layers with grouped-query attention, a tied head, random q/k head-norm scales
(ones would hide a missing or misplaced norm) and sliding windows of 8 positions on its last
two layers (`use_sliding_window`), so most positions of those layers see only part of the
context. Tolerance as in test_model_parity.py.
"""

from __future__ import annotations

import dataclasses

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

TOLERANCE = 1e-4
WINDOW = 8
NEW_TOKENS = 32


def tiny_qwen3_config(**overrides):
    """transformers' own Qwen3 config of the tiny test model (shapes as the other tiny ones)."""
    from transformers import Qwen3Config

    fields = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=True,
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=2,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
    )
    return Qwen3Config(**{**fields, **overrides})


def save_tiny_model(config, directory, tokenizer, seed: int):
    """A random float32 model of `config`, its norm scales random too, saved to `directory`
    with `tokenizer`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.copy_(1 + torch.randn_like(parameter) * 0.5)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def tiny_qwen3_dir(tmp_path_factory, hf_smollm2_tokenizer):
    directory = tmp_path_factory.mktemp("tiny-qwen3")
    return save_tiny_model(tiny_qwen3_config(), directory, hf_smollm2_tokenizer, seed=5)


@pytest.fixture(scope="module")
def tiny_qwen3(tiny_qwen3_dir):
    return etjax.load_model(tiny_qwen3_dir, dtype="float32")


@pytest.fixture(scope="module")
def hf_tiny_qwen3(tiny_qwen3_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).eval()


def test_tiny_qwen3_logits_match_transformers(tiny_qwen3, hf_tiny_qwen3):
    cfg = tiny_qwen3.config
    assert cfg.architecture == "qwen3" and cfg.tie_word_embeddings
    assert cfg.local_layers == (2, 3) and cfg.sliding_window == WINDOW
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(2, 64), dtype=np.int32)
    with torch.no_grad():
        reference = hf_tiny_qwen3(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    ours = full_logits(tiny_qwen3.weights, cfg, ids, page_size=4)
    assert relative_error(ours, reference) < TOLERANCE

    # The window and the head norms are visible in the logits: without either, far off.
    no_window = dataclasses.replace(cfg, local_layers=(), sliding_window=0)
    assert relative_error(full_logits(tiny_qwen3.weights, no_window, ids, 4), reference) > 1e-2
    unnormed = [
        dataclasses.replace(layer, q_norm=layer.q_norm * 0 + 1)
        for layer in tiny_qwen3.weights.layers
    ]
    weights = dataclasses.replace(tiny_qwen3.weights, layers=tuple(unnormed))
    assert relative_error(full_logits(weights, cfg, ids, 4), reference) > 1e-2


def test_tiny_qwen3_greedy_decode_matches_transformers(tiny_qwen3, hf_tiny_qwen3):
    # Through `decode()` (the engine: ragged prefill, cached decode steps in bursts), three
    # prompts of different lengths together, 32 new tokens each.
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, TINY_VOCAB, size=n).tolist() for n in (5, 21, 40)]
    texts = [tiny_qwen3.tokenizer.decode(p) for p in prompts]
    results = etjax.decode(
        texts, model=tiny_qwen3, max_new_tokens=NEW_TOKENS, ignore_eos=True, page_size=4
    )
    for result in results:
        # transformers' greedy search, in one teacher-forced pass (tests/greedy_reference.py).
        expected = greedy_choices(hf_tiny_qwen3, result.prompt_token_ids, result.token_ids)
        assert len(result.token_ids) == NEW_TOKENS and result.token_ids == expected


def assert_gguf_reads_as_hf_dir(model, hf_model, arch: str, tmp_path, **config_changes):
    """Write `hf_model` as llama.cpp lays out `arch` (F32); transformers must read the file
    back to the same tensors, to float32 rounding (so the layout is llama.cpp's as
    transformers knows it), and
    etjax to the config (with `config_changes`: what GGUF metadata does not carry) and the
    weights, bit for bit, that it reads from the Hugging Face directory, `model`."""
    import jax
    from transformers import AutoModelForCausalLM

    from etjax.loaders.gguf_weights import (
        gguf_model_config,
        gguf_tensors,
        load_gguf_weights,
        open_gguf,
    )
    from tests.gguf_builder import write_f32_gguf

    path = tmp_path / f"tiny-{arch}.gguf"
    write_f32_gguf(hf_model, path, arch)
    # transformers is given the config: it reads no head_dim from a qwen3 file (assuming
    # Qwen3's 128) and no window; etjax's reading of the metadata is checked below.
    reread = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, config=hf_model.config, dtype=torch.float32
    )
    expected = hf_model.state_dict()
    for name, tensor in reread.state_dict().items():  # Gemma's 1 + w - 1: float32 rounding
        torch.testing.assert_close(tensor, expected[name], msg=name)
    reader = open_gguf(path)
    cfg = gguf_model_config(reader, "float32")
    eps = float(np.float32(model.config.rms_norm_eps))  # GGUF metadata holds a float32
    assert cfg == dataclasses.replace(model.config, rms_norm_eps=eps, **config_changes)
    weights = load_gguf_weights(gguf_tensors(reader), cfg)
    jax.tree.map(np.testing.assert_array_equal, weights, model.weights)


def test_tiny_qwen3_gguf_loads_the_same_model(tiny_qwen3, hf_tiny_qwen3, tmp_path):
    # llama.cpp's qwen3 metadata has no sliding window (its Qwen3 attends to everything).
    assert_gguf_reads_as_hf_dir(
        tiny_qwen3, hf_tiny_qwen3, "qwen3", tmp_path, sliding_window=0, local_layers=()
    )


@pytest.mark.parametrize(
    "scaling",
    [
        # Qwen's long-context recipe; an original context of 16 puts the band of blended
        # frequencies inside head_dim 16, and the temperature (0.1 ln 4 + 1) applies.
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
        {"rope_type": "linear", "factor": 4.0},
    ],
    ids=lambda scaling: scaling["rope_type"],
)
def test_tiny_qwen3_rope_scaling_matches_transformers(scaling, tiny_qwen3_dir, tmp_path):
    # The same weights under a scaled config: every layer, windowed or not, rotates scaled,
    # at 64 positions (past yarn's original 16). The model written as llama.cpp's converter
    # writes it (the scaling as `qwen3.rope.scaling.*` keys) reads to the same config, less
    # the window llama.cpp's qwen3 does not have, and to transformers' logits without it (the
    # unscaled rotation was shown off above, on the same weights).
    import json
    import shutil

    from transformers import AutoModelForCausalLM

    directory = tmp_path / scaling["rope_type"]
    shutil.copytree(tiny_qwen3_dir, directory)
    config = json.loads((directory / "config.json").read_text())
    config["rope_parameters"] = {"rope_theta": 1000000.0, **scaling}
    (directory / "config.json").write_text(json.dumps(config))
    model = etjax.load_model(directory, dtype="float32")
    assert model.config.rope_scaling.rope_type == scaling["rope_type"]
    ids = np.random.default_rng(3).integers(0, TINY_VOCAB, size=(1, 64), dtype=np.int32)
    reference_model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        reference = reference_model(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    assert relative_error(full_logits(model.weights, model.config, ids, 4), reference) < TOLERANCE
    unscaled = dataclasses.replace(model.config, rope_scaling=None)
    assert relative_error(full_logits(model.weights, unscaled, ids, 4), reference) > 1e-2

    cfg, weights = gguf_of(reference_model, "qwen3", tmp_path)
    no_window = dataclasses.replace(model.config, sliding_window=0, local_layers=())
    assert cfg == dataclasses.replace(no_window, rms_norm_eps=float(np.float32(1e-6)))
    jax.tree.map(np.testing.assert_array_equal, weights, model.weights)
    config["use_sliding_window"] = False
    del config["layer_types"]
    (directory / "config.json").write_text(json.dumps(config))
    windowless = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        reference = windowless(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    assert relative_error(full_logits(weights, cfg, ids, 4), reference) < TOLERANCE


def gguf_of(hf_model, arch: str, tmp_path):
    """`hf_model` written as llama.cpp lays out `arch` (F32) and read by etjax: (config,
    weights)."""
    from etjax.loaders.gguf_weights import (
        gguf_model_config,
        gguf_tensors,
        load_gguf_weights,
        open_gguf,
    )
    from tests.gguf_builder import write_f32_gguf

    path = tmp_path / f"scaled-{arch}.gguf"
    write_f32_gguf(hf_model, path, arch)
    reader = open_gguf(path)
    cfg = gguf_model_config(reader, "float32")
    return cfg, load_gguf_weights(gguf_tensors(reader), cfg)


def test_qwen3_rope_scaling_fields_are_read():
    # Config only: linear's factor; yarn's temperature 0.1 ln(factor) + 1 and the context it
    # stretches the original to (Qwen's configs keep the original in max_position_embeddings).
    def read(scaling):
        raw = {**tiny_qwen3_config().to_dict(), "rope_parameters": scaling}
        return hf_config_to_model_config(raw, "float32", source="config.json")

    linear = read({"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6})
    assert (linear.rope_scaling.rope_type, linear.rope_scaling.factor) == ("linear", 2.0)
    yarn = read({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256})
    assert yarn.rope_scaling.attention_factor == pytest.approx(0.1 * np.log(4) + 1)
    assert yarn.max_position_embeddings == 1024


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "'dynamic'"),
    ],
)
def test_unsupported_qwen3_config_is_refused_by_name(change, named):
    raw = {**tiny_qwen3_config().to_dict(), **change}
    with pytest.raises(ModelLoadError, match=named):
        hf_config_to_model_config(raw, "float32", source="config.json")
