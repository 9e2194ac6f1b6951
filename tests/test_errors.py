"""Bad input gets a clear `EtjaxError` that names the problem, never a deep JAX traceback."""

from __future__ import annotations

import json

import pytest

import etjax
from etjax.engine_build import RuntimeOptions, build_engine
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


def test_max_context_refuses_longer_prompts_by_name_and_serves_the_rest(tiny):
    # 40 words are more than 24 positions with 4 new tokens; the engine serves rows of at
    # most max_context=24 tokens, and says which limit it is (the model's is 512).
    results = etjax.decode(
        ["The sky is", "word " * 40], model=tiny, max_new_tokens=4, max_context=24
    )
    assert results[0].ok and len(results[0].token_ids) == 4
    assert "the engine's context is 24 (max_context)" in results[1].error
    with pytest.raises(RequestError, match="max_context=1024; must be at most the model's"):
        etjax.decode("The sky is", model=tiny, max_new_tokens=4, max_context=1024)
    with pytest.raises(RequestError, match="max_context=0"):
        etjax.decode("The sky is", model=tiny, max_new_tokens=4, max_context=0)


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


# A config.json's fields that divide, index or size arrays: a zero, a negative, a value of the
# wrong kind is a ModelLoadError naming the file and the field, never Python's own error.
_LLAMA = dict(
    model_type="llama",
    vocab_size=100,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
_QWEN3_MOE = dict(
    _LLAMA, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32
)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(num_attention_heads=0), "num_attention_heads=0; must be an integer >= 1"),
        (dict(num_key_value_heads=0), "num_key_value_heads=0; must be an integer >= 1"),
        (dict(num_key_value_heads=3), "num_key_value_heads=3; must be a divisor of num_att"),
        (dict(head_dim=0), "head_dim=0; must be an integer >= 1"),
        (dict(head_dim="16"), "head_dim='16'; must be an integer >= 1"),
        (dict(vocab_size=0), "vocab_size=0; must be an integer >= 1"),
        (dict(num_hidden_layers=-1), "num_hidden_layers=-1; must be an integer >= 1"),
        (dict(hidden_size=[64]), r"hidden_size=\[64\]; must be an integer >= 1"),
        (dict(max_position_embeddings=0), "max_position_embeddings=0; must be an integer >= 1"),
        (dict(rope_theta=0), "rope_theta=0; must be a finite number > 1"),
        (dict(rms_norm_eps=-1e-6), "rms_norm_eps=-1e-06; must be a finite number >= 0"),
        (dict(model_type="mistral", sliding_window=-1), "sliding_window=-1; must be an integer"),
        (dict(rope_scaling="linear"), "rope_scaling='linear'; must be a JSON object"),
        (dict(rope_scaling=dict(rope_type="linear", factor=0)), r"rope_scaling\.factor=0; must"),
        (
            dict(rope_scaling=dict(rope_type="yarn", factor=4, beta_fast=0)),
            r"rope_scaling\.beta_fast=0; must be a finite number > 0",
        ),
        (
            dict(
                rope_scaling=dict(
                    rope_type="llama3",
                    factor=8,
                    low_freq_factor=1,
                    high_freq_factor=1,
                    original_max_position_embeddings=64,
                )
            ),
            r"rope_scaling\.high_freq_factor=1\.0; must be greater than low_freq_factor=1\.0",
        ),
        (
            dict(
                rope_scaling=dict(type="longrope", short_factor=[1.0] * 8),
                original_max_position_embeddings=1,
            ),
            "original_max_position_embeddings=1; must be an integer >= 2",
        ),
        (dict(model_type="qwen3", layer_types=5), "layer_types must list"),
        (
            dict(model_type="gemma3_text", sliding_window=8, sliding_window_pattern=0),
            "sliding_window_pattern=0; must be an integer >= 1",
        ),
        # The count of experts is named as the config names it, not as a field it lacks.
        (dict(_QWEN3_MOE, num_experts=0), "num_experts=0; must be an integer >= 1"),
        (
            dict(_LLAMA, model_type="mixtral", num_local_experts=0, num_experts_per_tok=2),
            "num_local_experts=0; must be an integer >= 1",
        ),
        (dict(_QWEN3_MOE, num_experts_per_tok=5), r"num_experts_per_tok=5; must be 1\.\.num_exp"),
        (dict(_QWEN3_MOE, decoder_sparse_step=0), "decoder_sparse_step=0; must be an integer"),
    ],
)
def test_bad_model_sizes_in_a_config_json_are_named(change, message):
    from etjax.loaders.hf_config import hf_config_to_model_config
    from etjax.model.rope import rope_inverse_frequencies

    raw = {**_LLAMA, **change}
    with pytest.raises(ModelLoadError, match=f"^config.json: {message}"):
        cfg = hf_config_to_model_config(raw, "float32", "config.json")
        rope_inverse_frequencies(cfg)  # where a zero factor would divide, had it passed


def test_a_config_json_nested_too_deeply_is_a_model_load_error(tmp_path):
    from etjax.loaders.hf_config import read_hf_config

    path = tmp_path / "config.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ModelLoadError, match=r"config\.json: JSON nested too deeply"):
        read_hf_config(path, "float32")


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("llama.attention.head_count", 0, "llama.attention.head_count=0; must be an integer >= 1"),
        ("llama.attention.head_count_kv", 3, "head_count_kv=3; must divide llama.attention.he"),
        ("llama.block_count", 0, "llama.block_count=0; must be an integer >= 1"),
        ("llama.attention.key_length", 0, "llama.attention.key_length=0; must be an integer"),
        ("llama.rope.freq_base", 0.0, r"rope_theta=0\.0; must be a finite number > 1"),
        ("llama.rope.scaling.original_context_length", 0, "original_context_length=0; must be"),
    ],
)
def test_bad_model_sizes_in_a_gguf_header_are_named(key, value, message):
    from pathlib import Path

    from etjax.gguf_file import GGUFFile
    from etjax.loaders.gguf_weights import gguf_model_config

    fields = {
        "general.architecture": "llama",
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2,
        "llama.embedding_length": 64,
        "llama.block_count": 2,
        "llama.feed_forward_length": 128,
        "llama.vocab_size": 100,
        "llama.rope.scaling.type": "yarn",
        key: value,
    }
    with pytest.raises(ModelLoadError, match=f"^m.gguf: .*{message}"):
        gguf_model_config(GGUFFile(Path("m.gguf"), fields, []), "float32")


@pytest.mark.parametrize(
    "line, message",
    [
        (b"[" * 100_000 + b"]" * 100_000, "line 1: JSON nested too deeply to read"),
        (b'{"prompt": "x", "arrival": NaN}', "line 1: arrival=nan; must be a finite number"),
        (b'{"prompt": "x", "priority": -Infinity}', "priority=-inf; must be a finite number"),
        (b'{"prompt": "\xff"}', "not UTF-8 text"),
    ],
)
def test_a_workload_file_too_deep_not_finite_or_not_utf8_is_a_config_error(tmp_path, line, message):
    from etjax.bench.workload_file import read_workload_file

    path = tmp_path / "w.jsonl"
    path.write_bytes(line + b"\n")
    with pytest.raises(ConfigError, match=f"w.jsonl.*{message}"):
        read_workload_file(path, model=None)  # refused before the prompt meets a tokenizer


_MANIFEST = json.dumps(
    {
        "format_version": 2,
        "config": dict(
            vocab_size=0, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=16,
        ),
    }
)  # fmt: skip


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("etjax_model.json", "[" * 100_000 + "]" * 100_000, "JSON nested too deeply to read"),
        ("etjax_model.json", "[1]", "malformed etjax manifest"),
        ("etjax_model.json", _MANIFEST, "vocab_size=0; must be an integer >= 1"),
        ("model.safetensors.index.json", "[" * 100_000, "JSON nested too deeply to read"),
        ("model.safetensors.index.json", '{"weight_map": [1]}', "weight_map must map tensor"),
        ("model.safetensors.index.json", '{"weight_map": {"a": 5}}', "weight_map must map tensor"),
    ],
)
def test_a_model_folders_json_that_is_deep_or_malformed_is_a_model_load_error(
    tmp_path, name, text, message
):
    (tmp_path / "config.json").write_text(json.dumps({**_LLAMA, "vocab_size": 49152}))
    (tmp_path / name).write_text(text)
    with pytest.raises(ModelLoadError, match=f"{name}: .*{message}"):
        etjax.load_model(tmp_path)
