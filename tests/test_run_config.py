"""Named run configs and model presets: every shipped file loads, and a bad file, table, key
or value is an error that names it."""

from __future__ import annotations

import pytest

from etjax.errors import ConfigError
from etjax.run_config import (
    available_configs,
    available_model_presets,
    is_model_preset,
    load_run_config,
)

ABLATION = ("baseline", "sampling_only", "scheduling_only", "pruning_only", "full")


def test_config_errors_name_the_file_table_and_key(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[pruning]\nmin_frac = 0.3\n")
    with pytest.raises(ConfigError, match=r"bad.toml: \[pruning\] unknown key 'min_frac'"):
        load_run_config(bad)
    bad.write_text("[engin]\npolicy = 'fcfs'\n")
    with pytest.raises(ConfigError, match=r"unknown table \[engin\]"):
        load_run_config(bad)
    bad.write_text("[engine]\npolicy = 'sjf'\n")
    with pytest.raises(ConfigError, match=r"\[engine\] policy='sjf'; must be one of"):
        load_run_config(bad)
    bad.write_text("[sampler]\ntemperature = -2\n")
    with pytest.raises(ConfigError, match=r"\[sampler\] temperature"):
        load_run_config(bad)
    with pytest.raises(ConfigError, match=r"not found.*available: baseline"):
        load_run_config("no-such-config")


@pytest.mark.parametrize(
    "table, line, message",
    [
        ("request", 'chat = "yes"', "[request] chat = 'yes'; must be true or false"),
        ("request", "stop = [1]", "[request] stop = [1]; must be a list of strings"),
        ("model", "name = 5", "[model] name = 5; must be a string"),
        ("engine", "max_batch_size = 2.5", "[engine] max_batch_size = 2.5; must be an integer"),
        ("engine", "num_pages = true", "[engine] num_pages = True; must be an integer"),
        ("pruning", 'enabled = "no"', "[pruning] enabled = 'no'; must be true or false"),
        ("sampler", 'top_p = "0.9"', "[sampler] top_p = '0.9'; must be a number"),
    ],
)
def test_every_key_is_checked_against_its_type(tmp_path, table, line, message):
    bad = tmp_path / "typed.toml"
    bad.write_text(f"[{table}]\n{line}\n")
    with pytest.raises(ConfigError) as refused:
        load_run_config(bad)
    assert str(refused.value) == f"{bad}: {message}"


@pytest.mark.parametrize(
    "text, message",
    [
        ("a = " + "[" * 100_000 + "]" * 100_000, "nested too deeply to read"),
        ("a = " + "{b = " * 5_000 + "1" + "}" * 5_000, "nested too deeply to read"),
        (b"[engine]\npolicy = '\xff'\n", "not UTF-8 text"),
    ],
)
def test_a_file_too_deep_or_not_utf8_is_a_config_error(tmp_path, text, message):
    bad = tmp_path / "deep.toml"
    bad.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ConfigError, match=f"deep.toml: .*{message}"):
        load_run_config(bad)


def test_a_huge_refused_value_is_echoed_cut_short(tmp_path):
    bad = tmp_path / "huge.toml"
    bad.write_text("[request]\nstop = [" + "1, " * 50_000 + "]\n")
    with pytest.raises(ConfigError) as refused:
        load_run_config(bad)
    message = str(refused.value)
    # repr of the list: "[" + "1, " * 49,999 + "1]" = 150,000 characters.
    assert message.startswith(f"{bad}: [request] stop = [1, 1, 1,")
    assert message.endswith("... (150000 chars); must be a list of strings")
    assert len(message) < len(str(bad)) + 300


def test_shipped_configs_load_and_differ_in_one_level_each():
    assert set(ABLATION) | {"default"} <= set(available_configs())
    configs = {name: load_run_config(name) for name in ("default", *ABLATION)}
    assert all(config.name == name for name, config in configs.items())
    levels = {
        name: (
            c.options.policy == "entropic",
            c.options.pruning.enabled,
            c.sampler.sampler == "entropic",
        )
        for name, c in configs.items()
    }
    assert levels["baseline"] == (False, False, False)
    assert levels["scheduling_only"] == (True, False, False)
    assert levels["pruning_only"] == (False, True, False)
    assert levels["sampling_only"] == (False, False, True)
    assert levels["full"] == (True, True, True)
    # Everything but the level under test is the baseline's.
    base = configs["baseline"]
    for name in ABLATION:
        c = configs[name]
        assert c.options.max_batch_size == base.options.max_batch_size
        assert c.options.steps_per_sync == base.options.steps_per_sync
        assert c.sampler.temperature == base.sampler.temperature


def test_shipped_model_presets_load_with_every_ablation_config():
    assert {"smollm2-135m", "smollm2-135m-bf16"} <= set(available_model_presets())
    for preset, dtype in (("smollm2-135m", "float32"), ("smollm2-135m-bf16", "bfloat16")):
        assert is_model_preset(preset)
        for name in ABLATION:
            config = load_run_config(name, model=preset)
            assert config.model.name == "smollm2-135m-instruct"
            assert config.model.dtype == dtype
            assert config.options == load_run_config(name).options
    assert not is_model_preset("smollm2-135m-instruct")  # a model name, not a preset


def test_a_preset_replaces_the_model_and_its_engine_keys_win(tmp_path):
    preset = tmp_path / "big.toml"
    preset.write_text(
        "[model]\nname = '/models/big'\ndtype = 'bfloat16'\n[engine]\npage_size = 32\n"
    )
    config = load_run_config("full", model=preset)
    assert (config.model.name, config.model.dtype) == ("/models/big", "bfloat16")
    assert config.options.page_size == 32
    assert config.options.policy == "entropic"  # the config's own keys stay
    assert config.options.pruning.enabled


def test_preset_errors_name_the_preset_file(tmp_path):
    preset = tmp_path / "bad_preset.toml"
    preset.write_text("[sampler]\ntemperature = 1.0\n")
    with pytest.raises(ConfigError, match=r"bad_preset.toml: unknown table \[sampler\]"):
        load_run_config("full", model=preset)
    preset.write_text("[model]\ndtype = 'float16'\n")
    with pytest.raises(ConfigError, match=r"bad_preset.toml: \[model\] dtype='float16'"):
        load_run_config("full", model=preset)
    preset.write_text("[engine]\npage_sise = 32\n")
    with pytest.raises(ConfigError, match=r"bad_preset.toml: \[engine\] unknown key 'page_sise'"):
        load_run_config("full", model=preset)
    with pytest.raises(ConfigError, match=r"model preset 'nope' not found.*smollm2-135m"):
        load_run_config("full", model="nope")


def test_a_presets_calibration_is_found_beside_it(tmp_path):
    # A relative path in a preset is relative to the preset's file, wherever the job runs.
    (tmp_path / "presets").mkdir()
    preset = tmp_path / "presets" / "calibrated.toml"
    preset.write_text("[model]\nname = '/models/m'\ncalibration = 'm-cal.json'\n")
    config = load_run_config("default", model=preset)
    assert config.model.calibration == str(tmp_path / "presets" / "m-cal.json")
    preset.write_text("[model]\ncalibration = 1.06\n")
    with pytest.raises(ConfigError, match=r"calibrated.toml: \[model\] calibration"):
        load_run_config("default", model=preset)
