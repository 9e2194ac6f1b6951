"""`etjax convert`: an orbax checkpoint restores to the same model, faster than the source."""

from __future__ import annotations

import chex
import jax.numpy as jnp
import numpy as np
import pytest

import etjax
from etjax.bench.corpus import lee_articles
from etjax.cli import main
from etjax.errors import ModelLoadError
from tests.model_runner import full_logits


def test_convert_roundtrip_gives_identical_logits_and_tokenizer(tiny_hf_dir, tmp_path, capsys):
    source = tiny_hf_dir("qwen2")
    destination = tmp_path / "converted"
    assert main(["convert", str(source), str(destination)]) == 0
    assert "saved" in capsys.readouterr().out

    original = etjax.load_model(source)
    restored = etjax.load_model(destination)
    assert restored.config == original.config
    # Every weight leaf restored exactly, in the same tree, shape and dtype; and so the logits.
    chex.assert_trees_all_equal(restored.weights, original.weights, strict=True)
    ids = np.random.default_rng(0).integers(0, original.config.vocab_size, (2, 40), np.int32)
    np.testing.assert_array_equal(
        full_logits(restored.weights, restored.config, ids),
        full_logits(original.weights, original.config, ids),
    )
    text = lee_articles()[5]
    assert restored.tokenizer.encode(text) == original.tokenizer.encode(text)
    assert restored.tokenizer.eos_token_ids == original.tokenizer.eos_token_ids
    messages = [{"role": "user", "content": "Hi"}]
    assert restored.tokenizer.apply_chat_template(messages) == (
        original.tokenizer.apply_chat_template(messages)
    )


def test_restore_in_another_dtype(tiny_hf_dir, tmp_path):
    destination = tmp_path / "converted"
    assert main(["convert", str(tiny_hf_dir("llama")), str(destination)]) == 0
    restored = etjax.load_model(destination, dtype="bfloat16")
    original = etjax.load_model(tiny_hf_dir("llama"))
    assert restored.config.dtype == "bfloat16"
    # The same tree and shapes; products in bfloat16, norms kept in float32.
    chex.assert_trees_all_equal_shapes(restored.weights, original.weights)
    layer = restored.weights.layers[0]
    chex.assert_type([restored.weights.embed, layer.wqkv, layer.w_down], jnp.bfloat16)
    chex.assert_type([restored.weights.final_norm, layer.attn_norm], jnp.float32)


def test_convert_refuses_non_empty_destination(tiny_hf_dir, tmp_path):
    (tmp_path / "file").write_text("x")
    model = etjax.load_model(tiny_hf_dir("llama"))
    from etjax.loaders.checkpoint import save_model

    with pytest.raises(ModelLoadError, match="not empty"):
        save_model(model, tmp_path)


def test_damaged_checkpoint_is_reported(tiny_hf_dir, tmp_path):
    import shutil

    destination = tmp_path / "converted"
    assert main(["convert", str(tiny_hf_dir("llama")), str(destination)]) == 0
    shutil.rmtree(destination / "weights")
    with pytest.raises(ModelLoadError, match="weights"):
        etjax.load_model(destination)


def test_unknown_checkpoint_version_is_named(tiny_hf_dir, tmp_path):
    import json

    destination = tmp_path / "converted"
    assert main(["convert", str(tiny_hf_dir("llama")), str(destination)]) == 0
    manifest_path = destination / "etjax_model.json"
    manifest = json.loads(manifest_path.read_text())
    manifest_path.write_text(json.dumps(manifest | {"format_version": 99}))
    with pytest.raises(ModelLoadError, match=r"format_version=99.*etjax convert"):
        etjax.load_model(destination)
