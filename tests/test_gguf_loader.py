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
from tests.conftest import relative_error
from tests.gguf_builder import write_llama_gguf
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

    ours = etjax.load_model(path)
    reference_model = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32
    )
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
