"""The `etjax` command line on a tiny model."""

from __future__ import annotations

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
