"""dtype "auto": bfloat16 on an accelerator, float32 on a CPU, everywhere a dtype is chosen."""

from __future__ import annotations

import pytest

import etjax
from etjax.errors import ConfigError, ModelLoadError, RequestError
from etjax.model.config import resolve_dtype
from etjax.run_config import load_run_config


@pytest.mark.parametrize(
    "dtype, platform, expected",
    [
        ("auto", "cpu", "float32"),
        ("auto", "gpu", "bfloat16"),
        ("auto", "tpu", "bfloat16"),
        ("float32", "tpu", "float32"),
        ("bfloat16", "cpu", "bfloat16"),
    ],
)
def test_auto_follows_the_platform(dtype, platform, expected):
    assert resolve_dtype(dtype, platform) == expected


def test_auto_is_the_default_and_a_conflict_is_an_error(tiny_hf_dir, tmp_path):
    model = etjax.load_model(tiny_hf_dir("llama"))  # this machine is a CPU
    assert model.config.dtype == "float32"
    assert etjax.decode("Hi", model=model, max_new_tokens=1, dtype="auto")[0].ok
    with pytest.raises(RequestError, match="loaded as float32"):
        etjax.decode("Hi", model=model, max_new_tokens=1, dtype="bfloat16")
    with pytest.raises(RequestError, match="dtype='float16'"):
        etjax.decode("Hi", model=model, dtype="float16")
    with pytest.raises(ModelLoadError, match="'float16' is not supported"):
        etjax.load_model(tiny_hf_dir("llama"), dtype="float16")
    (tmp_path / "c.toml").write_text('[model]\ndtype = "float16"\n')
    with pytest.raises(ConfigError, match="float16"):
        load_run_config(tmp_path / "c.toml")
    (tmp_path / "c.toml").write_text('[model]\ndtype = "auto"\n')
    assert load_run_config(tmp_path / "c.toml").model.dtype == "auto"
