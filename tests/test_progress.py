"""Progress where output is captured: plain log lines, work still to do as the total, and
rejected requests counted apart (they must not speed up the ETA)."""

from __future__ import annotations

import logging

from etjax import progress as progress_module
from etjax.progress import Progress


def test_captured_output_gets_log_lines_and_rejections_are_not_work(caplog, monkeypatch):
    monkeypatch.setattr(progress_module, "watched", lambda: False)
    with caplog.at_level(logging.INFO, logger="etjax"):
        bar = Progress(3, "records")
        bar.reject()
        bar.update(requests=1, tokens=10)
        bar.close()
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("records: 1/3 done, ") and "1 rejected" in line and "ETA" in line
    assert "\r" not in line


def test_decode_reports_progress_when_asked(tiny_hf_dir, caplog, monkeypatch):
    # decode()'s own part: the bar counts the prompts that are work and the outputs the
    # engine reports done. The engine is a stand-in that finishes each prompt with two tokens
    # (what the bar is fed is the subject here, not decoding: tests/test_engine*.py).
    import etjax
    from etjax import api
    from etjax.runtime.options import SequenceOutput

    def engine(weights, cfg, tokenizer, prompts, settings, options, on_text, on_done):
        outputs = [SequenceOutput(token_ids=[5, 6], finish_reason="length") for _ in prompts]
        for i, out in enumerate(outputs):
            on_done(i, out)
        return outputs

    monkeypatch.setattr(progress_module, "watched", lambda: False)
    monkeypatch.setattr(api, "generate_ids", engine)
    model = etjax.load_model(tiny_hf_dir("llama"))
    with caplog.at_level(logging.INFO, logger="etjax"):
        etjax.decode(["a", "b", ""], model=model, max_new_tokens=2, progress=True)
    (line,) = [r.getMessage() for r in caplog.records if "requests" in r.getMessage()]
    assert line.startswith("requests: 2/2 done")  # the empty prompt never was work


def test_bench_stages_log_a_line_each_with_an_eta(caplog, monkeypatch):
    from etjax.bench import stages

    monkeypatch.setattr(stages, "watched", lambda: False)
    with caplog.at_level(logging.INFO, logger="etjax"):
        progress = stages.StageProgress(2)
        progress.stage("warm-up")
        progress.stage("baseline")
        progress.close()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("bench 1/2, 0m00s elapsed: warm-up")
    assert lines[1].startswith("bench 2/2") and "ETA" in lines[1] and lines[1].endswith("baseline")
    assert lines[2].startswith("bench done in")
