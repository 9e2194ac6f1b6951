"""Hostile strings in batch records: lone surrogates (a JSON "\\ud800" decodes to a str that no
UTF-8 file can hold), NULs and 1 MB strings, in ids, custom ids, model names, stop strings,
metadata and field names, in native and OpenAI lines. Each record gets exactly one result line
that strict UTF-8 and JSON read back, the rest of the job runs, and a rerun neither crashes nor
writes an id twice. Jobs run on the mock device (tests/engine_mock.py): no model compiles."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import etjax
from etjax.distributed.processes import merge_shards
from etjax.engine.engine import Engine
from etjax.engine.policies import make_policy
from etjax.jobs.batch import run_batch
from etjax.jobs.results_file import ResultsFile, result_key
from etjax.run_config import load_run_config
from tests.engine_mock import MockBackend, token_of

LONE = "\ud800"  # what JSON's "\ud800" decodes to
NUL = "a\x00b"
BIG = "x" * 2**20
NEW = 3  # tokens per answer (ignore_eos: every answer is this long)
CONFIG = f"""
[engine]
max_batch_size = 2
max_resident = 2
steps_per_sync = 4

[request]
max_new_tokens = {NEW}
ignore_eos = true
"""


@pytest.fixture(scope="module")
def tiny(tiny_hf_dir):
    return etjax.load_model(tiny_hf_dir("llama"))


def _job(tiny, tmp_path: Path, lines: list[dict]) -> tuple:
    """Input file, output file and a `run_batch` call on the mock device."""
    src = tmp_path / "in.jsonl"
    # json.dumps escapes the surrogates ("\ud800" in the file), as any JSON writer must.
    src.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    config_path = tmp_path / "small.toml"
    config_path.write_text(CONFIG)
    config = load_run_config(config_path)
    options = config.options
    out = tmp_path / "out.jsonl"

    def make_engine(pages: int) -> Engine:
        backend = MockBackend(
            pages, options.steps_per_sync, options.page_size, vocab_size=tiny.config.vocab_size
        )
        policy = make_policy(options.policy, 1000.0, 1.0, options.max_batch_size, 16)
        return Engine(backend, tiny.tokenizer, options, policy)

    def run() -> dict:
        return run_batch(src, out, config, tiny, show_progress=False, make_engine=make_engine)

    return src, out, run


def _strict_lines(out: Path) -> list[dict]:
    # Strict UTF-8, and no string that UTF-8 cannot hold (json.loads would accept an escaped
    # lone surrogate, so every decoded line is re-encoded strictly).
    lines = [json.loads(line) for line in out.read_bytes().decode("utf-8").splitlines()]
    for line in lines:
        json.dumps(line, ensure_ascii=False).encode("utf-8")
    return lines


def _mock_tokens(tiny, prompt: str) -> list[int]:
    first = tiny.tokenizer.encode(prompt)[0]  # the mock's request id
    return [token_of(first, k) for k in range(NEW)]


def _by_key(lines: list[dict]) -> dict:
    keys = [result_key(line) for line in lines]
    assert len(keys) == len(set(keys)), "an id written twice"
    return dict(zip(keys, lines, strict=True))


# Each native record's result id, in input order (a bad id: its line number).
ORDER = [
    1,
    NUL,
    BIG,
    "stop-lone",
    "stop-nul-big",
    "name-lone",
    7,
    "prompt-nul",
    9,
    "temperature-big",
]


def test_hostile_strings_in_native_records_and_their_rerun(tiny, tmp_path):
    records = [
        {"id": LONE, "prompt": "one"},  # line 1
        {"id": NUL, "prompt": "two"},
        {"id": BIG, "prompt": "three"},
        {"id": "stop-lone", "prompt": "four", "stop": ["a" + LONE]},
        {"id": "stop-nul-big", "prompt": "five", "stop": [NUL, BIG]},
        {"id": "name-lone", "prompt": "six", "seed": 1, LONE: 1},
        {"id": [BIG], "prompt": "seven"},  # line 7: an id of the wrong type, a 1 MB one
        {"id": "prompt-nul", "prompt": "eight \x00 nine"},
        {"id": "a" + LONE, "prompt": "dup"},  # line 9: known by its number too, no duplicate
        {"id": "temperature-big", "prompt": "ten", "temperature": BIG},
    ]
    src, out, run = _job(tiny, tmp_path, records)
    summary = run()
    got = _by_key(_strict_lines(out))
    assert set(got) == {*ORDER}
    assert got[1]["error"] == (
        "line 1: id holds a lone surrogate '\\ud800' at character 0; an id must be Unicode text"
    )
    assert "at character 1" in got[9]["error"]
    assert got["temperature-big"]["error"].startswith("line 10: temperature=")
    assert len(got["temperature-big"]["error"]) < 4100  # not the 1 MB it quotes
    assert got["stop-lone"]["error"] == (
        "line 4: stop[0] holds a lone surrogate '\\ud800' at character 1; a record's strings "
        "must be Unicode text"
    )
    assert "line 6: a field name holds a lone surrogate '\\ud800'" in got["name-lone"]["error"]
    assert got[7]["error"].startswith("line 7: id=['xxxx") and len(got[7]["error"]) < 300
    for key, prompt in ((NUL, "two"), (BIG, "three"), ("stop-nul-big", "five")):
        assert got[key]["error"] is None and got[key]["id"] == key
        assert got[key]["token_ids"] == _mock_tokens(tiny, prompt)
    assert got["prompt-nul"]["token_ids"] == _mock_tokens(tiny, "eight \x00 nine")
    assert summary["records"] == 10 and summary["generated_tokens"] == 4 * NEW

    # The rerun retries the six errors (which fail again) and leaves the rest alone.
    done = {key: line for key, line in got.items() if line["error"] is None}
    summary = run()
    again = _by_key(_strict_lines(out))
    assert set(again) == set(got)
    assert summary["retried_errors"] == summary["run_now"] == 6
    assert {key: line for key, line in again.items() if line["error"] is None} == done

    # --ordered puts them back in input order, the bad ids at their own lines.
    merge_shards(src, out, [out])
    order = [result_key(line) for line in _strict_lines(out)]
    assert order == ORDER


def _openai(custom_id: str, url: str = "/v1/chat/completions", **body) -> dict:
    if url == "/v1/completions":
        body = {"prompt": "The sea"} | body
    else:
        body = {"messages": [{"role": "user", "content": "Name a river."}]} | body
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def test_hostile_strings_in_openai_lines_and_their_rerun(tiny, tmp_path):
    lines = [
        _openai(LONE),  # line 1
        _openai(NUL, model=NUL),
        _openai(BIG, "/v1/completions", model=BIG),
        _openai("model-lone", model="gpt-" + LONE),
        _openai("meta-lone", metadata={"note": LONE}),
        _openai("meta-nul-big", metadata={"note": NUL, "big": BIG}, user=BIG),
        _openai("stop-lone", stop=LONE),
        _openai("stop-nul-big", "/v1/completions", stop=[NUL, BIG]),
        _openai("content-lone", messages=[{"role": "user", "content": "x" + LONE}]),
        {"custom_id": [BIG], "url": "/v1/completions", "body": {"prompt": "x"}},  # line 10
    ]
    _, out, run = _job(tiny, tmp_path, lines)
    run()
    got = _by_key(_strict_lines(out))
    errors = {key: line["error"]["message"] for key, line in got.items() if line["error"]}
    assert errors.keys() == {1, "model-lone", "meta-lone", "stop-lone", "content-lone", 10}
    assert errors[1] == (
        "line 1: custom_id holds a lone surrogate '\\ud800' at character 0; an id must be "
        "Unicode text"
    )
    assert (
        "line 4: body.model holds a lone surrogate '\\ud800' at character 4" in errors["model-lone"]
    )
    assert "line 5: body.metadata.note holds a lone surrogate" in errors["meta-lone"]
    assert "line 7: body.stop holds a lone surrogate" in errors["stop-lone"]
    assert "line 9: body.messages[0].content holds a lone surrogate" in errors["content-lone"]
    assert errors[10].startswith("line 10: custom_id=['xxx") and len(errors[10]) < 300
    for key in (1, "model-lone", 10):
        assert got[key]["response"] is None and got[key]["custom_id"] == key
    assert got[NUL]["response"]["body"]["model"] == NUL
    assert got[BIG]["response"]["body"]["model"] == BIG and got[BIG]["custom_id"] == BIG
    assert got["meta-nul-big"]["response"]["body"]["model"] == tiny.name  # none given
    completion = got["stop-nul-big"]["response"]["body"]
    assert completion["usage"]["completion_tokens"] == NEW  # no stop string in the mock's text

    done = {key: line for key, line in got.items() if line["error"] is None}
    summary = run()
    again = _by_key(_strict_lines(out))
    assert set(again) == set(got) and summary["retried_errors"] == summary["run_now"] == 6
    assert {key: line for key, line in again.items() if line["error"] is None} == done


def test_a_result_holding_a_lone_surrogate_is_written_as_json_and_read_back(tmp_path):
    # The last line of defence: a string no check caught is written as JSON's \ud800 escape,
    # and a rerun knows the id.
    path = tmp_path / "out.jsonl"
    results = ResultsFile(path)
    results.append({"id": "r" + LONE, "error": None, "text": "caf\u00e9 " + LONE})
    results.append({"id": "next", "error": None})
    results.close()
    assert path.read_bytes().splitlines()[0] == (
        b'{"id": "r\\ud800", "error": null, "text": "caf\xc3\xa9 \\ud800"}'
    )
    reread = ResultsFile(path)
    reread.close()
    assert reread.done == {"r" + LONE, "next"}
