"""Seeds and n: identical prompts sample different texts, an explicit seed reproduces a call,
every result reports the seed it used and replays from it, alone or batched."""

from __future__ import annotations

import json

import pytest

import etjax
from etjax import request_checks
from etjax.jobs.records import parse_record
from etjax.run_config import load_run_config

SAMPLE = dict(max_new_tokens=8, temperature=1.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_hf_dir):
    return etjax.load_model(tiny_hf_dir("llama"))


def test_identical_prompts_differ_and_an_explicit_seed_reproduces_the_call(tiny):
    first = etjax.decode(["Tell me a joke."] * 4, model=tiny, seed=7, **SAMPLE)
    assert len({tuple(r.token_ids) for r in first}) == 4
    assert len({r.seed for r in first}) == 4
    again = etjax.decode(["Tell me a joke."] * 4, model=tiny, seed=7, **SAMPLE)
    assert [r.token_ids for r in again] == [r.token_ids for r in first]


def test_a_reported_seed_replays_its_result_alone(tiny):
    batch = etjax.decode(["A story:", "A poem:", "A list:"], model=tiny, seed=3, **SAMPLE)
    (alone,) = etjax.decode(["A poem:"], model=tiny, seed=[batch[1].seed], **SAMPLE)
    assert alone.token_ids == batch[1].token_ids and alone.seed == batch[1].seed


def test_no_seed_draws_fresh_ones_and_reports_them(tiny, monkeypatch):
    # The draw itself is the system's randomness; count it instead, so the test is exact.
    drawn = iter(range(100, 200))
    monkeypatch.setattr(request_checks.secrets, "randbits", lambda bits: next(drawn))
    results = etjax.decode(["Hi", "Hi"], model=tiny, **SAMPLE)
    assert [r.seed for r in results] == [100, 101]
    (replayed,) = etjax.decode(["Hi"], model=tiny, seed=[101], **SAMPLE)
    assert replayed.token_ids == results[1].token_ids


def test_n_gives_consecutive_samples_per_prompt(tiny):
    results = etjax.decode(["One", "", "Two"], model=tiny, n=3, seed=5, **SAMPLE)
    assert len(results) == 9
    assert [r.ok for r in results] == [True] * 3 + [False] * 3 + [True] * 3
    for i in (0, 2):
        samples = results[3 * i : 3 * i + 3]
        assert len({tuple(r.token_ids) for r in samples}) == 3
        assert len({tuple(r.prompt_token_ids) for r in samples}) == 1
    for bad in (0, 129, 1.5, True):
        with pytest.raises(etjax.RequestError, match=f"n={bad!r}; must be an integer from 1"):
            etjax.decode("x", model=tiny, n=bad)
    with pytest.raises(etjax.RequestError, match="one per request needs 6"):
        etjax.decode(["a", "b"], model=tiny, n=3, seed=[1, 2])


def test_batch_records_get_their_own_stream_from_the_config_seed_and_id(tiny, tmp_path):
    (tmp_path / "c.toml").write_text("[sampler]\ntemperature = 1.0\nseed = 11\n")
    config = load_run_config(tmp_path / "c.toml")
    line = lambda rid, **more: json.dumps({"id": rid, "prompt": "Hi", **more})  # noqa: E731
    seeds = [parse_record(line(r), 1, tiny, config).settings.sampler.seed for r in "ab"]
    assert seeds[0] != seeds[1]
    assert seeds[0] == request_checks.derived_seed(11, "a")  # the same on every rerun
    given = parse_record(line("a", seed=4), 1, tiny, config).settings.sampler.seed
    assert given == 4
