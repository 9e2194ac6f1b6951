"""The `etjax` command line on a tiny model."""

from __future__ import annotations

import json

import pytest

from etjax.cli import main


def test_generate_streams_text_and_prints_the_trace(tiny_hf_dir, capsys):
    code = main(
        [
            "generate",
            "The weather",
            "--model",
            str(tiny_hf_dir("llama")),
            "--max-new-tokens",
            "5",
            "--sampler",
            "entropic",
            "--target-entropy",
            "1.5",
            "--show-entropy",
        ]
    )
    captured = capsys.readouterr()
    assert code == 0
    table = captured.out.split("H model")[1].strip().splitlines()[1:]
    assert len(table) == 5  # one row per generated token
    assert "5 tokens" in captured.err


def test_invalid_sampler_setting_is_a_clear_error(tiny_hf_dir, capsys):
    code = main(["generate", "x", "--model", str(tiny_hf_dir("llama")), "--top-p", "1.5"])
    assert code == 2
    assert "top_p=1.5" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--temperature", "-1"], "temperature=-1"),
        (["--max-new-tokens", "0"], "max_new_tokens=0"),
        (["--top-k", "-3"], "top_k=-3"),
    ],
)
def test_generate_checks_settings_before_loading_the_model(tmp_path, capsys, flags, message):
    # The model path does not exist: the settings' error comes first, so they were checked
    # before any loading began.
    code = main(["generate", "x", "--model", str(tmp_path / "missing"), *flags])
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and "missing" not in err


def test_batch_runs_a_model_preset_as_it_runs_the_model_it_names(tiny_hf_dir, tmp_path, capsys):
    model_dir = tiny_hf_dir("llama")
    config = tmp_path / "small.toml"
    config.write_text("[engine]\nmax_batch_size = 2\n[request]\nmax_new_tokens = 4\n")
    preset = tmp_path / "tiny_preset.toml"
    preset.write_text(f"[model]\nname = {str(model_dir)!r}\n")
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": "a", "prompt": "The river"}\n{"id": "b", "prompt": "A bank"}\n')
    outputs = {}
    for label, model in (("preset", str(preset)), ("path", str(model_dir))):
        out = tmp_path / f"{label}.jsonl"
        argv = ["batch", "--input", str(src), "--output", str(out), "--config", str(config)]
        assert main([*argv, "--model", model, "--no-progress"]) == 0
        outputs[label] = [json.loads(line)["token_ids"] for line in out.read_text().splitlines()]
    assert outputs["preset"] == outputs["path"]
    assert len(outputs["preset"]) == 2

    missing = tmp_path / "missing.toml"
    argv = ["batch", "--input", str(src), "--output", str(tmp_path / "x.jsonl")]
    assert main([*argv, "--model", str(missing), "--no-progress"]) == 2
    assert "model preset" in capsys.readouterr().err


def _batch_error(capsys, *args: str) -> str:
    # The model path does not exist: these errors must come before any model is loaded.
    code = main(["batch", *args, "--model", "/nonexistent/model", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("etjax: error:") and "Traceback" not in err
    assert "/nonexistent/model" not in err
    return err


def test_bad_paths_and_environment_fail_before_the_model_loads(tmp_path, capsys, monkeypatch):
    source = tmp_path / "in.jsonl"
    source.write_text('{"prompt": "hi"}\n')
    out = tmp_path / "out.jsonl"
    err = _batch_error(capsys, "--input", str(tmp_path), "--output", str(out))
    assert f"input {tmp_path} is a directory" in err
    err = _batch_error(capsys, "--input", str(tmp_path / "absent.jsonl"), "--output", str(out))
    assert "not found" in err
    err = _batch_error(capsys, "--input", str(source), "--output", str(tmp_path))
    assert f"output {tmp_path} is a directory" in err
    err = _batch_error(capsys, "--input", str(source), "--output", str(source))
    assert "is the input file" in err
    err = _batch_error(capsys, "--input", str(source), "--output", str(tmp_path / "no" / "o"))
    assert "does not exist" in err
    monkeypatch.setenv("ETJAX_PROCESS_INDEX", "abc")
    err = _batch_error(capsys, "--input", str(source), "--output", str(out))
    assert "ETJAX_PROCESS_INDEX='abc'; must be an integer >= 0" in err


def test_convert_refuses_an_existing_file_as_destination(tmp_path, capsys):
    target = tmp_path / "taken"
    target.write_text("x")
    code = main(["convert", "/nonexistent/model", str(target)])
    err = capsys.readouterr().err
    assert code == 2 and f"destination {target} is an existing file" in err


def test_generate_takes_a_config_n_seeds_and_every_sampler_field(tiny_hf_dir, tmp_path, capsys):
    # The config's [sampler] temperature and [request] max_new_tokens are the defaults; -n 2
    # prints two samples with their seeds; the same --seed gives the same samples again;
    # a sampler field with no flag of its own before (--typical-p) is accepted.
    import etjax

    config = tmp_path / "c.toml"
    config.write_text("[sampler]\ntemperature = 1.0\n\n[request]\nmax_new_tokens = 4\n")
    model = str(tiny_hf_dir("llama"))
    command = ["generate", "Once", "--model", model, "--config", str(config), "-n", "2"]
    command += ["--seed", "9", "--typical-p", "0.95", "--ignore-eos"]
    assert main(command) == 0
    first = capsys.readouterr()
    assert first.out.count("--- sample") == 2
    assert first.err.count("4 tokens") == 2
    assert main(command) == 0
    assert capsys.readouterr().out == first.out
    # The same as decode() with those settings.
    expected = etjax.decode(
        "Once",
        model=etjax.load_model(model),
        n=2,
        seed=9,
        temperature=1.0,
        typical_p=0.95,
        max_new_tokens=4,
        ignore_eos=True,
    )
    for r in expected:
        assert f"(seed {r.seed}) ---\n{r.text}\n" in first.out


def test_a_switch_among_the_sampler_settings_is_a_flag_pair(monkeypatch):
    # A bool SamplerSettings field (none today; any later one) becomes --name / --no-name,
    # and takes only true or false.
    import dataclasses

    from etjax import generate_command
    from etjax.cli import _parser
    from etjax.errors import RequestError
    from etjax.sampling import SamplerSettings

    @dataclasses.dataclass(frozen=True)
    class WithSwitch(SamplerSettings):
        greedy_fallback: bool = False

    monkeypatch.setattr(generate_command, "SamplerSettings", WithSwitch)
    parser = _parser()
    assert parser.parse_args(["generate", "x", "--greedy-fallback"]).greedy_fallback is True
    assert parser.parse_args(["generate", "x", "--no-greedy-fallback"]).greedy_fallback is False
    assert parser.parse_args(["generate", "x"]).greedy_fallback is None  # the config decides
    assert WithSwitch(greedy_fallback=True).greedy_fallback is True
    with pytest.raises(RequestError, match="greedy_fallback=1; must be true or false"):
        WithSwitch(greedy_fallback=1)


def test_generate_help_names_each_default_once(capsys):
    # Flags default to None ("not given": a config may set them), so argparse's own default
    # suffix would print "(default: None)" beside the real default the help already names.
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: None)" not in text
    assert "(default 128)" in text  # max_new_tokens, from the request-field table
    assert text.count("(default 128)") == 1


def test_generate_reports_a_failed_generation_and_exits_non_zero(tiny_hf_dir, capsys, monkeypatch):
    # A constrained request the grammar engine failed on (finish "error") must not look like a
    # success: the reason is logged and the exit status is 1. decode() is replaced by one whose
    # result is such a failure (the CLI opens no constraint flag to cause one for real).
    import etjax.api
    from etjax.api import Result

    failed = Result(text="c", finish_reason="error", error="choices: llguidance failed", seed=7)
    monkeypatch.setattr(etjax.api, "decode", lambda *args, **kwargs: [failed])
    code = main(["generate", "Pick one:", "--model", str(tiny_hf_dir("llama"))])
    captured = capsys.readouterr()
    assert code == 1
    assert "finish: error" in captured.err
    assert "choices: llguidance failed" in captured.err
