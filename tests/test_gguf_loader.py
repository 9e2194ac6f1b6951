"""etjax's GGUF reader against transformers' on every supported tensor type.

Both sides dequantize the same bytes, so they must agree to float32 rounding; a wrong block
layout, scale or q/k un-permutation would be off by orders of magnitude.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

import etjax
from etjax.model.config import RopeScaling
from tests.conftest import relative_error
from tests.gguf_builder import write_llama_gguf
from tests.hf_references import load_reference_model
from tests.model_runner import full_logits

TOLERANCE = 1e-4


SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "matrix_type",
    [
        "F16",
        "Q8_0",
        "Q4_0",
        "Q4_1",
        pytest.param("F32", marks=SLOW),
        pytest.param("BF16", marks=SLOW),
        pytest.param("Q5_0", marks=SLOW),
        pytest.param("Q5_1", marks=SLOW),
    ],
)
def test_gguf_logits_match_transformers(matrix_type, tiny_hf_dir, smollm2_path, tmp_path):
    from transformers import AutoModelForCausalLM

    source = AutoModelForCausalLM.from_pretrained(tiny_hf_dir("llama"), dtype=torch.float32)
    path = tmp_path / f"tiny-{matrix_type}.gguf"
    write_llama_gguf(source, path, smollm2_path, GGMLQuantizationType[matrix_type])

    ours = etjax.load_model(path, weights="float32")
    reference_model = load_reference_model(path)
    ids = np.random.default_rng(0).integers(0, ours.config.vocab_size, (2, 48), np.int32)
    with torch.no_grad():
        reference = reference_model(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    assert relative_error(full_logits(ours.weights, ours.config, ids), reference) < TOLERANCE


def test_unsupported_tensor_type_is_named(tiny_hf_dir, smollm2_path, tmp_path):
    from transformers import AutoModelForCausalLM

    source = AutoModelForCausalLM.from_pretrained(tiny_hf_dir("llama"), dtype=torch.float32)
    path = tmp_path / "tiny-q8_1.gguf"
    # Q8_1 is llama.cpp's activation format: gguf has no dequantizer for it.
    write_llama_gguf(source, path, smollm2_path, GGMLQuantizationType.Q8_1)
    with pytest.raises(etjax.ModelLoadError, match=r"Q8_1.*allowed"):
        etjax.load_model(path)


def _rope_header(path, arch, keys, tensors=()):
    # A GGUF file with the metadata `gguf_model_config` reads (head_dim 16, context 512),
    # `keys` ({arch}.rope.scaling.key: value) and the named tensors ({name: values}).
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(512)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(32)
    writer.add_head_count(4)
    writer.add_vocab_size(64)
    add = {str: writer.add_string, int: writer.add_uint32, float: writer.add_float32}
    for key, value in keys.items():
        add[type(value)](f"{arch}.rope.scaling.{key}", value)
    for name, values in dict(tensors).items():
        writer.add_tensor(name, np.asarray(values, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _gguf_config(path):
    from etjax.loaders.gguf_weights import gguf_model_config, open_gguf

    return gguf_model_config(open_gguf(path), "float32")


def test_gguf_llama3_rope_freqs_rotate_as_transformers(tmp_path):
    # Llama 3.1's scaling as llama.cpp's converter writes it: no key, the divisor of each
    # frequency as tensor rope_freqs (here from transformers' own llama3 frequencies; band
    # 16..64 of head_dim 16 keeps one pair, blends one and slows the rest). etjax rotates by
    # transformers' frequencies; the file's context is served whole.
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from etjax.model.rope import rope_inverse_frequencies

    llama3 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
    hf = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, **llama3}
        | {"original_max_position_embeddings": 64},
    )
    expected = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")[0].numpy()
    unscaled = 1.0 / 10000.0 ** (np.arange(0, 16, 2) / 16)
    path = tmp_path / "llama3.gguf"
    _rope_header(path, "llama", {}, {"rope_freqs.weight": unscaled / expected})
    cfg = _gguf_config(path)
    assert (cfg.rope_scaling.rope_type, cfg.rope_scaling.factor) == ("llama3", 8.0)
    assert cfg.max_position_embeddings == 512
    ours = np.asarray(rope_inverse_frequencies(cfg))
    np.testing.assert_allclose(ours, expected, rtol=1e-6)
    assert np.abs(ours / unscaled - 1).max() > 0.8  # scaled, on all but the fastest pairs


def test_gguf_rope_scaling_keys_read_as_the_hf_config(tmp_path):
    # Linear: the factor; yarn: the context it stretches the original to, its betas and
    # temperature as the file gives them, transformers' temperature 0.1 ln(factor) + 1 where
    # the file has none (and where it has that value, rounded to float32).
    def read(keys):
        path = tmp_path / "x.gguf"
        _rope_header(path, "qwen3", keys)
        return _gguf_config(path)

    linear = read({"type": "linear", "factor": 2.0})
    assert linear.rope_scaling == RopeScaling("linear", factor=2.0)
    yarn = {"type": "yarn", "factor": 4.0, "original_context_length": 256}
    cfg = read(yarn)
    assert cfg.max_position_embeddings == 1024
    assert cfg.rope_scaling.attention_factor == 0.1 * np.log(4.0) + 1
    cfg = read({**yarn, "yarn_attn_factor": float(0.1 * np.log(4.0) + 1)})
    assert cfg.rope_scaling.attention_factor == 0.1 * np.log(4.0) + 1
    cfg = read({**yarn, "yarn_beta_fast": 16.0, "yarn_beta_slow": 2.0, "yarn_attn_factor": 1.5})
    scaling = cfg.rope_scaling
    assert (scaling.beta_fast, scaling.beta_slow, scaling.attention_factor) == (16.0, 2.0, 1.5)
    assert read({"type": "none", "original_context_length": 512}).rope_scaling is None


SHORT = {"rope_factors_short.weight": np.ones(8)}


@pytest.mark.parametrize(
    ("arch", "keys", "tensors", "named"),
    [
        ("qwen3", {"type": "dynamic"}, (), r"type='dynamic'.*allowed: \('none', 'linear'"),
        ("qwen3", {"type": "yarn", "factor": 4.0, "yarn_log_multiplier": 0.1}, (), "log_mul"),
        ("qwen3", {"type": "yarn", "factor": 4.0, "yarn_ext_factor": 0.5}, (), "ext_factor"),
        ("qwen3", {"type": "linear", "factor": 2.0, "alpha": 1.0}, (), r"alpha=1\.0.*keys"),
        ("qwen3", {"type": "linear"}, (), r"lacks qwen3\.rope\.scaling\.factor"),
        ("qwen3", {"attn_factor": 2.0}, (), r"attn_factor=2\.0.*allowed: 1\.0"),
        ("gemma2", {"type": "linear", "factor": 2.0}, (), r"gemma2; allowed: \('none',\)"),
        ("phi3", {"type": "yarn"}, SHORT, r"type='yarn' beside tensor 'rope_factors_short"),
        ("phi3", {}, SHORT, "lacks phi3.rope.scaling.original_context_length"),
        (
            "phi3",
            {"original_context_length": 64},
            {"rope_factors_short.weight": np.ones(4)},
            r"shape \[4\].*allowed: \[8\]",
        ),
    ],
)
def test_gguf_rope_scaling_etjax_cannot_compute_is_refused_by_name(
    arch, keys, tensors, named, tmp_path
):
    path = tmp_path / "x.gguf"
    _rope_header(path, arch, keys, tensors)
    with pytest.raises(etjax.ModelLoadError, match=named):
        _gguf_config(path)
