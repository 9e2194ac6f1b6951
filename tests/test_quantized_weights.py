"""Weights kept quantized (etjax/model/quantized.py): int8 per channel within half a scale, a
quantized model's greedy tokens equal to its own dequantization's, a GGUF's blocks equal to the
gguf package's dequantization of the same file, refusal by name, and the `weights` option
through load_model, TOML, the CLI and a converted checkpoint."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest
from gguf import GGMLQuantizationType

import etjax
from etjax.calibration.identity import weights_fingerprint
from etjax.cli import _parser, main
from etjax.errors import ConfigError, ModelLoadError
from etjax.gguf_file import read_gguf
from etjax.model.quantized import (
    QuantizedWeight,
    auto_weights,
    dequantize_weights,
    int8_weight,
    is_quantized,
    resolve_weights,
    weight_formats,
    weights_bytes,
)
from etjax.model.weights import abstract_weights
from etjax.run_config import load_run_config
from tests.gguf_builder import write_llama_gguf

PROMPT = "The history of the city begins"


def _greedy(model, tokens: int = 8) -> list[int]:
    return etjax.decode(PROMPT, model=model, max_new_tokens=tokens, ignore_eos=True)[0].token_ids


# A weight's dequantization as one program a format and shape, as the engine's steps run it
# (run op by op, each of its reshapes, shifts and products compiled a program of its own:
# 62 compiles for three SmolLM2 layers' weights).
_dequantized = jax.jit(QuantizedWeight.dequantize)


def _matrices_equal(quantized, reference) -> None:
    # Every quantized leaf dequantizes to the reference's float matrix exactly; the other
    # leaves are the same arrays.
    ours_leaves = jax.tree.leaves(quantized, is_leaf=is_quantized)
    pairs = list(zip(ours_leaves, jax.tree.leaves(reference), strict=True))
    assert any(isinstance(q, QuantizedWeight) for q, _ in pairs)
    for q, r in pairs:
        ours = _dequantized(q) if isinstance(q, QuantizedWeight) else q
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(r))


@pytest.fixture(scope="module")
def tiny_gguf(tiny_hf_dir, smollm2_path, tmp_path_factory):
    """The tiny llama written as a GGUF with its matrices in a block type, by the type's name:
    one transformers load and one write a type for the module (Q8_0 serves two tests)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_hf_dir("llama"))
    directory = tmp_path_factory.mktemp("tiny-gguf")
    written = {}

    def make(matrix_type: str):
        if matrix_type not in written:
            path = directory / f"tiny-{matrix_type}.gguf"
            write_llama_gguf(hf, path, smollm2_path, GGMLQuantizationType[matrix_type])
            written[matrix_type] = path
        return written[matrix_type]

    return make


def test_int8_error_is_at_most_half_a_scale_per_channel():
    # q = round(w / s) is within 1/2 of w / s, so |w - s q| <= s / 2 with s = max|w| / 127 per
    # row, up to the float32 roundings of w / s and of s q (a few ulps of max|w|).
    rows = np.linspace(-3.0, 3.0, 8 * 96, dtype=np.float32).reshape(8, 96)
    rows = rows * np.float32([1e-3, 0.1, 1, 10, 1e3, 1, 1, 0])[:, None]  # row 7: all zeros
    rows[5, 7] = 500.0  # one outlier: only its own row's scale grows
    rows[6] = np.sin(np.arange(96, dtype=np.float32))
    w = int8_weight(rows)
    assert w.format.name == "int8" and w.quants.dtype == np.int8 and w.scales.shape == (8, 1)
    scale = np.abs(rows).max(axis=1) / 127
    error = np.abs(np.asarray(w.dequantize()) - rows).max(axis=1)
    slack = 4 * np.finfo(np.float32).eps * np.abs(rows).max(axis=1)
    assert np.all(error <= scale / 2 + slack)
    assert error[7] == 0 and np.all(np.abs(np.asarray(w.quants)).max(axis=1)[:7] == 127)


def test_int8_model_greedy_equals_its_dequantization(tiny_hf_dir):
    source = tiny_hf_dir("llama")
    model = etjax.load_model(source, weights="int8")
    assert set(weight_formats(model.weights).values()) == {"int8"}
    assert model.weights.layers[0].attn_norm.dtype == np.float32  # norms stay float
    reference = dataclasses.replace(model, weights=jax.jit(dequantize_weights)(model.weights))
    assert _greedy(model) == _greedy(reference)


@pytest.mark.parametrize(
    "matrix_type, held", [("Q4_1", "q4_1"), ("Q8_0", "q8_0"), ("Q5_0", "q8_0")]
)
def test_stored_blocks_are_the_files_values(matrix_type, held, tiny_gguf):
    # The truth: the gguf package's dequantization of the same file (the float32 load).
    path = tiny_gguf(matrix_type)
    stored = etjax.load_model(path, weights="stored")
    dequantized = etjax.load_model(path, weights="float32")
    assert set(weight_formats(stored.weights).values()) == {held}  # Q5_0: in Q8_0's layout
    # Equal weights: the same model (its greedy tokens on the kernels: the SmolLM2 test),
    # which a calibration file fitted on either recognises.
    _matrices_equal(stored.weights, dequantized.weights)
    assert weights_fingerprint(stored.weights) == weights_fingerprint(dequantized.weights)


def test_a_block_type_the_kernels_cannot_read_is_refused_by_name(tiny_gguf):
    path = tiny_gguf("Q5_1")
    with pytest.raises(ModelLoadError) as refused:
        etjax.load_model(path, weights="stored")
    for named in (str(path), "'blk.0.attn_q.weight'", "type Q5_1", "Q4_1", "Q5_0", "int8"):
        assert named in str(refused.value)
    with pytest.raises(ModelLoadError, match=r"weights='int4'.*allowed"):
        etjax.load_model(path, weights="int4")
    # "auto" never refuses a file: what it cannot keep as blocks loads as floats.
    assert weight_formats(etjax.load_model(path).weights) == {}


def test_auto_keeps_blocks_only_on_one_cpu_device_in_float32():
    # The rule, against the cases worked out by hand: blocks the kernels read, float32, one
    # CPU device, kernels built; anything else keeps float matrices in the model's dtype.
    assert auto_weights("float32", {"Q4_1", "Q8_0"}, "cpu", 1, True) == "stored"
    assert auto_weights("float32", {"Q4_K", "Q6_K", "Q5_K"}, "cpu", 1, True) == "stored"
    assert auto_weights("float32", {"Q5_1"}, "cpu", 1, True) == "float32"  # none readable
    assert auto_weights("float32", (), "cpu", 1, True) == "float32"  # a float file, HF folder
    assert auto_weights("bfloat16", {"Q4_1"}, "cpu", 1, True) == "bfloat16"
    assert auto_weights("float32", {"Q4_1"}, "cpu", 8, True) == "float32"  # a mesh
    assert auto_weights("float32", {"Q4_1"}, "cpu", 1, False) == "float32"  # no kernels
    for platform in ("tpu", "gpu"):
        assert auto_weights("bfloat16", {"Q4_1"}, platform, 1, True) == "bfloat16"
    assert resolve_weights("auto", "bfloat16") == "bfloat16"  # a plan: no file's blocks
    assert resolve_weights("int8", "float32", block_types={"Q4_1"}) == "int8"  # asked for


@pytest.mark.parametrize("matrix_type, held", [("Q8_0", {"q8_0"}), ("F32", set())])
def test_auto_loads_a_quantized_gguf_as_blocks_on_this_cpu(
    matrix_type, held, tiny_gguf, tiny_hf_dir
):
    from cpp_kernels import cpu_kernels_available

    path = tiny_gguf(matrix_type)
    expected = held if cpu_kernels_available() else set()  # without kernels: floats
    assert set(weight_formats(etjax.load_model(path).weights).values()) == expected
    assert weight_formats(etjax.load_model(tiny_hf_dir("llama")).weights) == {}


# etjax against itself over a short prompt, 16 tokens: compiles more than it runs, so it
# compiles cheaply (tests/compile_level.py).
@pytest.mark.compile_bound
def test_smollm2_q4_1_stored_is_the_file(smollm2, smollm2_path):
    stored = etjax.load_model(smollm2_path, weights="stored")
    assert set(weight_formats(stored.weights).values()) == {"q4_1", "q8_0"}  # embedding Q8_0
    # Resident bytes against the file's tensors (Q4_1: 20 bytes per 32 weights, as stored).
    tensor_bytes = sum(t.nbytes for t in read_gguf(smollm2_path).tensors)
    assert weights_bytes(stored.weights) <= 1.2 * tensor_bytes
    assert weights_bytes(smollm2.weights) > 5 * tensor_bytes  # float32: the 538 MB of today
    # The embedding (Q8_0) and a first and a last layer (Q4_1; the tiny models check all).
    some = lambda w: (w.embed, w.layers[0], w.layers[-1])  # noqa: E731
    _matrices_equal(some(stored.weights), some(smollm2.weights))
    # Equal weights, so the logits differ by float32 summation order alone (the kernels'
    # against XLA's and the row-products kernel's): at most n * 2^-24 of the sum of |terms|
    # of a product (n <= 1,536, about 1e-4 relative), which moves a log-probability by at
    # most twice the largest logit's change: under 1e-2 for logits of magnitude < 30.
    ours, reference = (
        etjax.decode(PROMPT, model=m, max_new_tokens=16, ignore_eos=True, prompt_logprobs=True)[0]
        for m in (stored, smollm2)
    )
    assert ours.token_ids == reference.token_ids  # greedy, 16 tokens
    np.testing.assert_allclose(ours.prompt_logprobs[1:], reference.prompt_logprobs[1:], atol=1e-2)
    np.testing.assert_allclose(ours.logprob, reference.logprob, atol=1e-2)


def test_weights_option_in_toml_and_cli(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text('[model]\nweights = "int8"\n')
    assert load_run_config(config).model.weights == "int8"
    assert load_run_config("baseline").model.weights == "auto"
    config.write_text('[model]\nweights = "int4"\n')
    with pytest.raises(ConfigError, match=r"c.toml: \[model\] weights='int4'.*'stored'"):
        load_run_config(config)
    parser = _parser()
    assert parser.parse_args(["generate", "x", "--weights", "stored"]).weights == "stored"
    assert parser.parse_args(["generate", "x"]).weights is None  # the config decides
    assert parser.parse_args(["convert", "a", "b", "--weights", "int8"]).weights == "int8"
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "x", "--weights", "int4"])


def test_convert_saves_int8_and_the_next_load_reads_it(tiny_hf_dir, tmp_path):
    source = tiny_hf_dir("llama")
    destination = tmp_path / "int8"
    assert main(["convert", str(source), str(destination), "--weights", "int8"]) == 0
    manifest = json.loads((destination / "etjax_model.json").read_text())
    assert manifest["format_version"] == 3 and manifest["matrices"][".embed"] == "int8"
    quantized = etjax.load_model(source, weights="int8")
    # What a planner counts for weights="int8" is what the load holds.
    planned = abstract_weights(quantized.config, "int8")
    assert jax.tree.structure(planned) == jax.tree.structure(quantized.weights)
    assert weights_bytes(planned) == weights_bytes(quantized.weights)
    restored = etjax.load_model(destination)
    jax.tree.map(np.testing.assert_array_equal, restored.weights, quantized.weights)
    as_float = etjax.load_model(destination, weights="float32")
    assert weight_formats(as_float.weights) == {}
    _matrices_equal(restored.weights, as_float.weights)
