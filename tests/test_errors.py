"""Bad input gets a clear `EtjaxError` that names the problem, never a deep JAX traceback."""

from __future__ import annotations

import json

import pytest

import etjax
from etjax.engine.build import RuntimeOptions, build_engine
from etjax.errors import ConfigError, ModelLoadError, RequestError
from etjax.runtime.footprint import check_fits, engine_bytes


@pytest.fixture(scope="module")
def tiny(tiny_hf_dir):
    return etjax.load_model(tiny_hf_dir("llama"))


def test_a_missing_path_is_not_taken_for_a_hub_id(tmp_path):
    # An absolute path is never a hub id: nothing is fetched, and the error says what is
    # accepted.
    with pytest.raises(ModelLoadError, match="nor a Hugging Face hub id"):
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
        (dict(trusted_chat="yes"), "trusted_chat='yes'; must be True or False"),
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
    with pytest.raises(RequestError, match="must be a string, a list of messages"):
        etjax.decode(b"bytes", model=tiny)
    with pytest.raises(RequestError, match="empty list"):
        etjax.decode([], model=tiny)


def test_cli_reports_errors_without_traceback(capsys, tmp_path):
    from etjax.cli import main

    code = main(["generate", "hi", "--model", str(tmp_path / "missing")])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.err.startswith("etjax: error:") and "Traceback" not in captured.err


def test_sizes_that_cannot_fit_are_refused_before_allocating(tiny):
    with pytest.raises(ConfigError, match="2000000 resident rows") as refused:
        etjax.decode("hello", model=tiny, max_batch_size=10**6)
    assert "GiB but the device has" in str(refused.value)
    options = RuntimeOptions(num_pages=10**9)  # as a config's [engine] num_pages would say
    with pytest.raises(ConfigError, match="num_pages=1000000000 x page_size=16"):
        build_engine(tiny.weights, tiny.config, tiny.tokenizer, options)
    with pytest.raises(ValueError, match="page_size=1000000; must be at most 1024"):
        etjax.decode("hello", model=tiny, page_size=10**6)


def test_the_engine_footprint_is_the_pool_and_the_row_state(tiny):
    # Tiny llama: 2 layers, 2 KV heads, head_dim 16, vocabulary 49152, float32. Pages of 4
    # tokens: K and V are 2 x 2 x 2 x 16 x 4 bytes per token, bounds and mass 2 x 2 x 33 x 4 per
    # page; three [rows + 1, V] arrays of 4 + 4 + 1 bytes.
    need = engine_bytes(tiny.config, num_pages=10, page_size=4, rows=3)
    assert need == {
        "kv_cache": 10 * 4 * (2 * 2 * 2 * 16 * 4) + 10 * 2 * 2 * 33 * 4,
        "row_state": 4 * 49152 * 9,
    }
    check_fits(tiny.config, 10, 4, 3, free=sum(need.values()))  # exactly fits
    with pytest.raises(ConfigError, match="num_pages=10 x page_size=4"):
        check_fits(tiny.config, 10, 4, 3, free=sum(need.values()) - 1)


def test_a_huge_refused_value_is_echoed_cut_short_naming_the_field():
    from etjax.errors import FieldError
    from etjax.request_fields import FIELDS

    stop = [""] * 50_000  # refused: stop strings are non-empty; repr is 200,000 characters
    with pytest.raises(FieldError) as refused:
        FIELDS["stop"].read(stop)
    message = str(refused.value)
    assert message.startswith("stop=['', '', ")
    assert "... (200000 chars); must be a non-empty string or a list" in message
    assert len(message) < 300 and refused.value.value is stop  # the value itself stays whole


def test_json_nested_too_deeply_is_a_field_error():
    from etjax.errors import FieldError
    from etjax.request_fields import FIELDS

    deep: dict = {}
    inner = deep
    for _ in range(100_000):
        inner["a"] = inner = {}
    for schema in ("[" * 100_000 + "]" * 100_000, deep):  # as JSON text, and as an object
        with pytest.raises(FieldError, match=r"^json_schema=") as refused:
            FIELDS["json_schema"].read(schema)
        assert "deep" in refused.value.allowed and len(str(refused.value)) < 400
    with pytest.raises(FieldError, match=r"^json_schema=<dict nested too deeply to show>"):
        FIELDS["json_schema"].read(deep)
