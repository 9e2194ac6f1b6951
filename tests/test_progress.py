"""Progress where output is captured: plain log lines, work still to do as the total, and
rejected requests counted apart (they must not speed up the ETA)."""

from __future__ import annotations

import logging

from etjax import progress as progress_module
from etjax.progress import Progress


def test_captured_output_gets_log_lines_and_rejections_are_not_work(caplog, monkeypatch):
    monkeypatch.setattr(progress_module, "_watched", lambda: False)
    with caplog.at_level(logging.INFO, logger="etjax"):
        bar = Progress(3, "records")
        bar.reject()
        bar.update(requests=1, tokens=10)
        bar.close()
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("records: 1/3 done, ") and "1 rejected" in line and "ETA" in line
    assert "\r" not in line


def test_decode_reports_progress_when_asked(tiny_hf_dir, caplog, monkeypatch):
    import etjax

    monkeypatch.setattr(progress_module, "_watched", lambda: False)
    model = etjax.load_model(tiny_hf_dir("llama"))
    with caplog.at_level(logging.INFO, logger="etjax"):
        etjax.decode(["a", "b", ""], model=model, max_new_tokens=2, progress=True)
    (line,) = [r.getMessage() for r in caplog.records if "requests" in r.getMessage()]
    assert line.startswith("requests: 2/2 done")  # the empty prompt never was work
