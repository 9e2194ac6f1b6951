"""A constrained request the grammar engine cannot serve is never reported as a success, on a
tiny random model (its outputs are anyone's, which is the point: the invariant holds for any
model). A constraint whose failure its first masks show is refused at submit, a `FieldError`
naming the field and llguidance's reason, short however large the value; one llguidance fails
on while generating finishes "error" with that reason (`decode()`, native and OpenAI batch
lines), the other rows unaffected. Over hypothesis-drawn schemas and regexes, an output that
finishes "eos" satisfies its constraint (jsonschema, `re.fullmatch`) and any other finishes
"length" or "error" with a message."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import etjax
from etjax.constraints import matcher
from etjax.engine_build import RequestSettings, RuntimeOptions, generate_ids
from etjax.errors import FieldError
from etjax.jobs import openai_format
from etjax.jobs.batch import run_batch
from etjax.run_config import load_run_config
from tests.hypothesis_profiles import examples
from tests.json_schemas import SCHEMAS

# Failures the first masks show: (field, value, llguidance's words for it).
REFUSED = {
    # The example: a row of more than 2000 items, met after the forced "c".
    "2000 choices": ("choices", [f"c{i}" for i in range(2000)], "max is 2000"),
    "a $ref cycle": (
        "json_schema",
        {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}},
        "no token can continue",
    ),
    # Every instance nests {"a": ...} forever.
    "only infinite instances": (
        "json_schema",
        {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
        "Too many items",
    ),
    "an empty regex": ("regex", "[a&&b]", "no token can continue"),  # an empty class
    "only infinite strings": ("grammar", 'start: "a" start', "Too many items"),
}
# Failures after a choice the model makes ("a" or "b"), so only generating meets them.
FAILING_LATE = {
    "choices": tuple([f"a{i}" for i in range(2001)] + [f"b{i}" for i in range(2001)]),
    "grammar": 'start: ("a" | "b") x\nx: "y" x',
}
OPTIONS = RuntimeOptions()  # decode()'s, so its programs


def _refuse(constant: str):
    raise ValueError(f"{constant} is not JSON")


@pytest.fixture(scope="module")
def tiny(tiny_hf_dir):
    return etjax.load_model(tiny_hf_dir("llama"))


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_constraint_its_first_masks_fail_is_refused_at_submit_naming_the_field(tiny, name):
    field, value, words = REFUSED[name]
    with pytest.raises(FieldError) as refused:
        etjax.decode("Pick one:", model=tiny, max_new_tokens=16, **{field: value})
    message = str(refused.value)
    assert refused.value.field == field and words in message, message
    assert len(message) < 600, message  # the value cut, llguidance's parser state left out
    assert matcher.live_count() == 0


def test_a_failed_row_is_an_error_line_and_the_other_rows_are_unaffected(tiny, tmp_path):
    config_path = tmp_path / "small.toml"
    config_path.write_text("[request]\nmax_new_tokens = 6\n")
    conversation = [{"role": "user", "content": "Pick one."}]
    choices = list(FAILING_LATE["choices"])
    lines = [
        {"id": "late", "prompt": "Pick one:", "choices": choices},
        {"id": "two", "prompt": "Pick one:", "grammar": FAILING_LATE["grammar"], "n": 2},
        {"id": "early", "prompt": "Pick one:", "regex": "[a&&b]"},
        {"id": "fine", "prompt": "Pick one:", "regex": "[ab]"},
        {
            "custom_id": "chat-late",
            "url": openai_format.CHAT,
            "body": {"messages": conversation, "guided_choice": choices},
        },
        {
            "custom_id": "chat-fine",
            "url": openai_format.CHAT,
            "body": {"messages": conversation, "guided_regex": "[ab]"},
        },
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    run_batch(src, out, load_run_config(config_path), tiny, show_progress=False)
    written = [json.loads(line, parse_constant=_refuse) for line in out.read_text().splitlines()]
    by_id = {r.get("custom_id", r.get("id")): r for r in written}
    late = by_id["late"]
    assert late["finish_reason"] == "error"
    assert late["error"].startswith("line 1: choices: llguidance failed"), late["error"]
    two = by_id["two"]
    assert two["error"].startswith("line 2: sample 0: grammar: llguidance failed"), two["error"]
    assert [s["finish_reason"] for s in two["samples"]] == ["error", "error"]
    assert by_id["early"]["error"].startswith("line 3: regex='[a&&b]'; must be a constraint")
    fine = by_id["fine"]
    assert fine["error"] is None and fine["finish_reason"] == "eos" and fine["text"] in "ab"
    chat = by_id["chat-late"]
    assert chat["response"] is None and chat["error"]["code"] == "generation_failed"
    assert chat["error"]["message"].startswith("line 5: choices: llguidance failed")
    (choice,) = by_id["chat-fine"]["response"]["body"]["choices"]
    assert by_id["chat-fine"]["error"] is None
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] in ("a", "b")


@pytest.mark.parametrize("field", list(FAILING_LATE))
def test_a_constraint_llguidance_fails_on_while_generating_finishes_as_an_error(tiny, field):
    (result,) = etjax.decode(
        "Pick one:", model=tiny, max_new_tokens=8, **{field: FAILING_LATE[field]}
    )
    assert result.finish_reason == "error" and not result.ok
    assert result.error.startswith(f"{field}: llguidance failed"), result.error
    assert len(result.error) < 400
    assert matcher.live_count() == 0


# Regexes of the shapes extraction jobs use, Rust and Python alike.
PIECES = st.sampled_from(["[a-z]", "[0-9]", "(yes|no)", "[A-Z][a-z]", "-", " ", "x"])
REPEATS = st.sampled_from(["", "?", "{1,3}", "{2}", "+"])
REGEXES = st.lists(st.tuples(PIECES, REPEATS), min_size=1, max_size=4).map(
    lambda parts: "".join(p if not r else f"(?:{p}){r}" for p, r in parts)
)
NEW_TOKENS = 12


@pytest.mark.compile_bound
@settings(max_examples=examples(2))
@given(
    schemas=st.lists(SCHEMAS, min_size=4, max_size=4),
    regexes=st.lists(REGEXES, min_size=4, max_size=4),
)
def test_an_output_that_finishes_eos_satisfies_its_constraint(tiny, schemas, regexes):
    # Eight rows in one engine: the tiny model's draws are as good as random, so rows end
    # anywhere the masks let them; "eos" must mean a complete, valid output all the same.
    fields = [{"json_schema": json.dumps(s)} for s in schemas] + [{"regex": r} for r in regexes]
    prompts = [tiny.tokenizer.encode("Answer:")] * len(fields)
    settings_ = [RequestSettings(max_new_tokens=NEW_TOKENS, **f) for f in fields]
    outs = generate_ids(tiny.weights, tiny.config, tiny.tokenizer, prompts, settings_, OPTIONS)
    for ask, out in zip(fields, outs, strict=True):
        if out.finish_reason == "eos":
            assert out.error is None
            if "regex" in ask:
                assert re.fullmatch(ask["regex"], out.text), (ask, out.text)
            else:
                jsonschema.validate(json.loads(out.text), json.loads(ask["json_schema"]))
        elif out.finish_reason == "length":
            assert out.error is None and len(out.token_ids) == NEW_TOKENS
        else:
            assert out.finish_reason == "error" and out.error, (ask, out)
    assert matcher.live_count() == 0
