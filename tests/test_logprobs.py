"""Top-k log-probabilities of generated tokens (`decode(..., logprobs=k)`): against
log_softmax of the distribution each token was drawn from, beside rows that do not ask, and
under speculation. Prompt log-probabilities (`prompt_logprobs=True`): against transformers'
log_softmax on the same weights, over prompts prefilled in several chunks."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import etjax
from etjax.drafting import SpeculationConfig
from etjax.engine_build import RequestSettings, RuntimeOptions, generate_ids
from etjax.errors import FieldError
from etjax.jobs import openai_format
from etjax.jobs.batch import run_batch
from etjax.run_config import load_run_config
from etjax.sampling import SamplerSettings
from tests.compile_counter import counting_new_programs

OPTIONS = RuntimeOptions(num_pages=64, prefill_chunk=64)


@pytest.fixture(scope="module")
def tiny(tiny_hf_dir):
    return etjax.load_model(tiny_hf_dir("llama"))


def _check_pairs(out, k: int) -> None:
    assert out.top_logprobs is not None and len(out.top_logprobs) == len(out.token_ids)
    for token, logprob, pairs in zip(out.token_ids, out.logprob, out.top_logprobs, strict=True):
        ids = [t for t, _ in pairs]
        values = [v for _, v in pairs]
        assert len(pairs) == k and len(set(ids)) == k
        assert values == sorted(values, reverse=True)
        assert all(v <= 0.0 for v in values)
        # The drawn token's own log-probability is of the same distribution: when it is among
        # the top k, the two agree (greedy: it is the first).
        if token in ids:
            assert values[ids.index(token)] == pytest.approx(logprob, abs=1e-5)


def test_a_row_with_logprobs_leaves_its_neighbours_unchanged_and_compiles_nothing(tiny):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, tiny.config.vocab_size, size=n).tolist() for n in (9, 14, 5)]
    options = OPTIONS

    def run(ks: list[int]):
        settings = [
            RequestSettings(
                max_new_tokens=6, logprobs=k, sampler=SamplerSettings(temperature=0.8, seed=i)
            )
            for i, k in enumerate(ks)
        ]
        return generate_ids(tiny.weights, tiny.config, tiny.tokenizer, prompts, settings, options)

    plain = run([0, 0, 0])
    assert all(out.top_logprobs is None for out in plain)
    with counting_new_programs() as compiles:
        mixed = run([0, 5, 0])
        other = run([20, 20, 1])
    assert compiles[0] == 0  # k is traced: no program per k, none for asking at all
    for a, b, c in zip(plain, mixed, other, strict=True):
        assert a.token_ids == b.token_ids == c.token_ids
        assert a.logprob == b.logprob == c.logprob
    assert mixed[0].top_logprobs is None and mixed[2].top_logprobs is None
    _check_pairs(mixed[1], 5)
    _check_pairs(other[0], 20)
    _check_pairs(other[1], 20)
    _check_pairs(other[2], 1)
    assert [p[:5] for p in other[1].top_logprobs] == mixed[1].top_logprobs


def _reference(directory, prompt: list[int]) -> np.ndarray:
    # log p(prompt[j] | prompt[:j]) for j >= 1 from one transformers pass.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    logprobs = torch.log_softmax(logits[:-1], dim=-1)
    return logprobs[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])].numpy()


def test_prompt_logprobs_match_transformers_and_leave_neighbours_unchanged(tiny, tiny_hf_dir):
    rng = np.random.default_rng(5)
    # 90 tokens in chunks of 64 (targets cross a chunk's edge, and the first chunk a tile's:
    # it sits at flat tokens 9-72), beside two short prompts that do not ask.
    prompts = [rng.integers(3, tiny.config.vocab_size, size=n).tolist() for n in (9, 90, 5)]
    options = OPTIONS

    def run(asks: list[bool]):
        settings = [
            RequestSettings(
                max_new_tokens=4,
                prompt_logprobs=a,
                sampler=SamplerSettings(temperature=0.8, seed=i),
            )
            for i, a in enumerate(asks)
        ]
        return generate_ids(tiny.weights, tiny.config, tiny.tokenizer, prompts, settings, options)

    plain = run([False] * 3)
    assert all(out.prompt_logprobs is None for out in plain)
    with counting_new_programs() as compiles:
        mixed = run([False, True, False])
    assert compiles[0] == 0  # asking changes no shape
    for a, b in zip(plain, mixed, strict=True):
        assert a.token_ids == b.token_ids and a.logprob == b.logprob
    assert mixed[0].prompt_logprobs is None and mixed[2].prompt_logprobs is None
    ours = mixed[1].prompt_logprobs
    assert len(ours) == len(prompts[1]) and ours[0] is None
    reference = _reference(tiny_hf_dir("llama"), prompts[1])
    np.testing.assert_allclose(ours[1:], reference, atol=1e-4, rtol=0)


def test_accepted_drafts_carry_their_top_logprobs(tiny, monkeypatch):
    # Drafts by an oracle (the plain run's tokens, every third one wrong: the tiny model
    # copies nothing), so drafts are accepted and rejected; the accepted ones report the
    # top-k of the distribution they were verified against, the plain run's.
    import etjax.engine.engine as engine_module
    from tests.test_speculation import FORCED, _oracle

    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, tiny.config.vocab_size, size=12).tolist()]
    settings = [
        RequestSettings(
            max_new_tokens=16,
            ignore_eos=True,
            logprobs=3,
            sampler=SamplerSettings(temperature=0.8, seed=3),
        )
    ]

    def run(speculation: SpeculationConfig):
        options = RuntimeOptions(num_pages=64, page_size=4, speculation=speculation)
        return generate_ids(tiny.weights, tiny.config, tiny.tokenizer, prompts, settings, options)

    plain = run(SpeculationConfig())
    monkeypatch.setattr(
        engine_module, "lookup_draft", _oracle(prompts, plain, tiny.config.vocab_size)
    )
    fast = run(FORCED)[0]
    plain = plain[0]
    assert fast.metrics["passes_per_token"] < 1  # drafts were accepted
    assert fast.token_ids == plain.token_ids
    for a, b in zip(plain.top_logprobs, fast.top_logprobs, strict=True):
        assert [t for t, _ in a] == [t for t, _ in b]
        np.testing.assert_allclose([v for _, v in a], [v for _, v in b], atol=1e-4)
    _check_pairs(fast, 3)


def test_batch_records_and_openai_lines_carry_the_top_logprobs_decode_gives(tiny, tmp_path):
    config_path = tmp_path / "small.toml"
    config_path.write_text("[request]\nmax_new_tokens = 4\nignore_eos = true\n")
    config = load_run_config(config_path)
    conversation = [{"role": "user", "content": "Name a river."}]
    lines = [
        {"id": "plain", "prompt": "The river bank", "logprobs": 2, "prompt_logprobs": True},
        {"id": "none", "prompt": "The river bank"},
        {
            "custom_id": "chat",
            "url": openai_format.CHAT,
            "body": {"messages": conversation, "logprobs": True, "top_logprobs": 2},
        },
        {
            "custom_id": "chosen",
            "url": openai_format.CHAT,
            "body": {"messages": conversation, "logprobs": True},
        },
        {"custom_id": "off", "url": openai_format.CHAT, "body": {"messages": conversation}},
        {"id": "big", "prompt": "x", "logprobs": 21},
        {
            "custom_id": "bad",
            "url": openai_format.CHAT,
            "body": {"messages": conversation, "logprobs": True, "top_logprobs": 21},
        },
        {
            "custom_id": "alone",
            "url": openai_format.CHAT,
            "body": {"messages": conversation, "top_logprobs": 2},
        },
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    run_batch(src, out, config, tiny, show_progress=False)
    by_id = {
        r.get("custom_id", r.get("id")): r for r in map(json.loads, out.read_text().splitlines())
    }
    (plain,) = etjax.decode(
        "The river bank",
        model=tiny,
        max_new_tokens=4,
        ignore_eos=True,
        logprobs=2,
        prompt_logprobs=True,
    )
    # Another batch than decode's: the same tokens, the values up to float rounding.
    got = by_id["plain"]["top_logprobs"]
    assert [[t for t, _ in top] for top in got] == [
        [t for t, _ in top] for top in plain.top_logprobs
    ]
    np.testing.assert_allclose(
        [[v for _, v in top] for top in got],
        [[v for _, v in top] for top in plain.top_logprobs],
        atol=1e-5,
    )
    prompt = by_id["plain"]["prompt_logprobs"]
    assert prompt[0] is None and len(prompt) == len(plain.prompt_token_ids)
    np.testing.assert_allclose(prompt[1:], plain.prompt_logprobs[1:], atol=1e-5)
    assert "top_logprobs" not in by_id["none"] and "prompt_logprobs" not in by_id["none"]
    (chat,) = etjax.decode(
        [conversation], model=tiny, max_new_tokens=4, ignore_eos=True, logprobs=2
    )
    (choice,) = by_id["chat"]["response"]["body"]["choices"]
    content = choice["logprobs"]["content"]
    assert len(content) == len(chat.token_ids)
    for entry, token, logprob, top in zip(
        content, chat.token_ids, chat.logprob, chat.top_logprobs, strict=True
    ):
        text = tiny.tokenizer.decode([token])
        assert entry["token"] == text and entry["bytes"] == list(text.encode("utf-8"))
        assert entry["logprob"] == pytest.approx(logprob, abs=1e-5)
        assert [e["token"] for e in entry["top_logprobs"]] == [
            tiny.tokenizer.decode([t]) for t, _ in top
        ]
        assert [e["logprob"] for e in entry["top_logprobs"]] == pytest.approx(
            [v for _, v in top], abs=1e-5
        )
    (chosen,) = by_id["chosen"]["response"]["body"]["choices"]
    assert [e["top_logprobs"] for e in chosen["logprobs"]["content"]] == [[]] * 4
    (off,) = by_id["off"]["response"]["body"]["choices"]
    assert off["logprobs"] is None
    # Asking changes the answer, hence the fingerprint; not asking leaves it as it was.
    assert by_id["off"]["fingerprint"] != by_id["chosen"]["fingerprint"]
    assert by_id["big"]["error"] == "line 6: logprobs=21; must be an integer from 0 to 20"
    assert by_id["bad"]["error"]["message"] == (
        "line 7: body.top_logprobs=21; must be an integer from 0 to 20"
    )
    assert by_id["alone"]["error"]["message"] == (
        "line 8: body.top_logprobs needs body.logprobs: true"
    )


@pytest.mark.parametrize("value", [21, -1, "x", True, 2.0])
def test_a_bad_logprobs_is_a_field_error_at_decode(tmp_path, value):
    with pytest.raises(FieldError) as refused:
        etjax.decode("x", model=str(tmp_path / "missing"), logprobs=value)
    assert (refused.value.field, refused.value.value) == ("logprobs", value)
    assert str(refused.value) == f"logprobs={value!r}; must be an integer from 0 to 20"


def _strict(line: str) -> dict:
    # JSON as RFC 8259 has it: NaN and Infinity, which Python's json writes, are refused.
    def refuse(constant: str):
        raise ValueError(f"{constant} is not JSON: {line[:200]}")

    return json.loads(line, parse_constant=refuse)


def test_under_a_constraint_top_logprobs_hold_only_allowed_tokens_and_lines_are_strict_json(
    tiny, tmp_path, monkeypatch
):
    # "[ab]" allows the tokens "a" and "b", then only end-of-sequence: with k = 5, two pairs
    # each time, the whole of a distribution renormalised over them (their probabilities sum
    # to 1), never the forbidden tokens the top 5 would pad with at -inf.
    import etjax.engine.engine as engine_module

    letters = {tiny.tokenizer.encode(c, add_special_tokens=False)[0] for c in "ab"}
    eos = set(tiny.tokenizer.eos_token_ids)

    def check(tops: list[list]) -> None:
        assert {t for t, _ in tops[0]} == letters and len(tops[0]) == 2, tops
        assert all({t for t, _ in top} <= eos for top in tops[1:]), tops
        for top in tops:
            assert np.exp([v for _, v in top]).sum() == pytest.approx(1.0, abs=1e-5)

    (result,) = etjax.decode("Pick a letter:", model=tiny, regex="[ab]", logprobs=5)
    assert result.finish_reason == "eos" and result.text in ("a", "b")
    check(result.top_logprobs)

    # A NaN the engine should never produce (here planted in one record's prompt
    # log-probabilities) becomes that record's error line, naming where: never invalid JSON.
    original = engine_module._record_prompt_logprobs

    def planted(seq, job, values):
        original(seq, job, values)
        if seq.settings.logprobs == 3:
            seq.output.prompt_logprobs[1] = float("nan")

    monkeypatch.setattr(engine_module, "_record_prompt_logprobs", planted)
    config_path = tmp_path / "small.toml"
    config_path.write_text("[request]\nmax_new_tokens = 4\n")
    conversation = [{"role": "user", "content": "Pick a letter."}]
    asks = {"regex": "[ab]", "logprobs": 5, "prompt_logprobs": True}
    lines = [
        {"id": "native", "prompt": "Pick a letter:", **asks},
        {"id": "nan", "prompt": "Pick a letter:", "logprobs": 3, "prompt_logprobs": True},
        {"id": "refused", "prompt": "x", "logprobs": 21},
        {
            "custom_id": "chat",
            "url": openai_format.CHAT,
            "body": {
                "messages": conversation,
                "guided_regex": "[ab]",
                "logprobs": True,
                "top_logprobs": 5,
            },
        },
        {"custom_id": "chat-refused", "url": openai_format.CHAT, "body": {"messages": 1}},
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    run_batch(src, out, load_run_config(config_path), tiny, show_progress=False)
    written = out.read_text().splitlines()
    by_id = {r.get("custom_id", r.get("id")): r for r in map(_strict, written)}
    assert len(written) == len(by_id) == len(lines)
    native = by_id["native"]
    assert native["error"] is None and native["finish_reason"] == "eos"
    check(native["top_logprobs"])
    assert by_id["nan"]["error"] == (
        "line 2: the result holds prompt_logprobs[1]=nan, not a finite number"
    )
    assert by_id["refused"]["error"] and by_id["chat-refused"]["error"]["message"]
    (choice,) = by_id["chat"]["response"]["body"]["choices"]
    content = choice["logprobs"]["content"]
    texts = {tiny.tokenizer.decode([t]) for t in letters}
    assert {e["token"] for e in content[0]["top_logprobs"]} == texts
    assert np.exp([e["logprob"] for e in content[0]["top_logprobs"]]).sum() == pytest.approx(1.0)
