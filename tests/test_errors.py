"""Bad input gets a clear `EtjaxError` that names the problem, never a deep JAX traceback."""

from __future__ import annotations

import json

import pytest

import etjax
from etjax.errors import ModelLoadError, RequestError


@pytest.fixture(scope="module")
def tiny(tiny_hf_dir):
    return etjax.load_model(tiny_hf_dir("llama"))


def test_missing_path_says_nothing_is_downloaded(tmp_path):
    with pytest.raises(ModelLoadError, match="never downloads"):
        etjax.load_model(tmp_path / "nope")


def test_missing_gguf_file(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        etjax.load_model(tmp_path / "model.gguf")


def test_corrupt_gguf_file(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ModelLoadError, match=r"broken\.gguf"):
        etjax.load_model(path)


def test_truncated_real_gguf(tmp_path, smollm2_path):
    path = tmp_path / "truncated.gguf"
    path.write_bytes(smollm2_path.read_bytes()[:5_000_000])
    with pytest.raises(ModelLoadError, match=r"truncated\.gguf"):
        etjax.load_model(path)


def test_pickle_checkpoint_is_refused(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(ModelLoadError, match=r"pickle.*safetensors"):
        etjax.load_model(tmp_path)
    with pytest.raises(ModelLoadError, match="pickle"):
        etjax.load_model(tmp_path / "pytorch_model.bin")


def test_unsupported_architecture(tiny_hf_dir, tmp_path):
    import shutil

    directory = tmp_path / "gpt2ish"
    shutil.copytree(tiny_hf_dir("llama"), directory)
    config = json.loads((directory / "config.json").read_text())
    config["model_type"] = "gpt2"
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="model_type='gpt2'"):
        etjax.load_model(directory)


def test_corrupt_config_and_missing_weights(tiny_hf_dir, tmp_path):
    import shutil

    directory = tmp_path / "broken"
    shutil.copytree(tiny_hf_dir("llama"), directory)
    (directory / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="safetensors"):
        etjax.load_model(directory)
    (directory / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        etjax.load_model(directory)


def test_corrupt_safetensors(tiny_hf_dir, tmp_path):
    import shutil

    directory = tmp_path / "corrupt"
    shutil.copytree(tiny_hf_dir("llama"), directory)
    (directory / "model.safetensors").write_bytes(b"\x10\x00\x00\x00garbage")
    with pytest.raises(ModelLoadError, match=r"model\.safetensors"):
        etjax.load_model(directory)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(max_new_tokens=0), "max_new_tokens=0"),
        (dict(max_new_tokens=-3), "max_new_tokens=-3"),
        (dict(max_new_tokens=2.5), "max_new_tokens=2.5"),
        (dict(temperature=-1.0), "temperature=-1.0"),
        (dict(temperature=float("nan")), "temperature=nan"),
        (dict(stop=[""]), "stop"),
        (dict(seed=-1), "seed=-1"),
        # A flag is a bool: "no" is a non-empty string and would read as True.
        (dict(chat="no"), "chat='no'; must be True or False"),
        (dict(ignore_eos="no"), "ignore_eos='no'; must be True or False"),
        (dict(raise_on_invalid=1), "raise_on_invalid=1; must be True or False"),
        (dict(pruning="yes"), "pruning='yes'; must be True, False or a PruningConfig"),
    ],
)
def test_bad_settings_are_rejected_before_running(tiny, kwargs, match):
    with pytest.raises(RequestError, match=match):
        etjax.decode("hello", model=tiny, **kwargs)


def test_bad_prompts_are_reported_per_prompt(tiny):
    too_long = "word " * 600  # the tiny model's context is 512 positions
    results = etjax.decode(
        ["The sky is", "", too_long, 42, "Once upon a time"], model=tiny, max_new_tokens=4
    )
    assert [r.ok for r in results] == [True, False, False, False, True]
    assert "prompt 1 is empty" in results[1].error
    assert "context is 512" in results[2].error
    assert "int" in results[3].error
    assert len(results[0].token_ids) == 4 and len(results[4].token_ids) == 4
    assert results[1].token_ids == [] and results[1].finish_reason is None


def test_bad_prompt_raises_when_asked(tiny):
    with pytest.raises(RequestError, match="prompt 0 is empty"):
        etjax.decode("   ", model=tiny, raise_on_invalid=True)


def test_prompts_of_wrong_type(tiny):
    with pytest.raises(RequestError, match="string or a list"):
        etjax.decode(b"bytes", model=tiny)
    with pytest.raises(RequestError, match="empty list"):
        etjax.decode([], model=tiny)


def test_cli_reports_errors_without_traceback(capsys, tmp_path):
    from etjax.cli import main

    code = main(["generate", "hi", "--model", str(tmp_path / "missing")])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.err.startswith("etjax: error:") and "Traceback" not in captured.err
