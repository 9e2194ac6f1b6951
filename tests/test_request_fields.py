"""The table of request fields (etjax/request_fields.py) against what each door does.

The doors a field is open at, its flags and OpenAI names, and the messages of bad values are
written out here by hand: the table may not drift from them, and every door (decode(), a
batch record, an OpenAI line, a run config's [request] table, `etjax generate`) must take
what the table says it takes, refuse the rest by name, and give a bad value the same error.
"""

from __future__ import annotations

import dataclasses
import inspect
import json

import pytest

import etjax
from etjax.cli import _parser, main
from etjax.errors import ConfigError, FieldError, RequestError
from etjax.jobs import openai_format
from etjax.jobs.records import parse_record
from etjax.request_fields import FIELDS, RequestSettings
from etjax.run_config import RunConfig, load_run_config

ALL = {"decode", "record", "toml", "cli"}
DOORS = {
    "max_new_tokens": ALL,
    "ignore_eos": ALL,
    "stop": ALL,
    "chat": ALL,
    "system_prompt": ALL,
    "trusted_chat": {"decode", "toml"},  # a record cannot vouch for itself
    "n": {"decode", "record", "cli"},
    "priority": {"record"},
    "logprobs": {"decode", "record", "toml"},
    "prompt_logprobs": {"decode", "record", "toml"},
    "json_schema": {"decode", "record"},
    "regex": {"decode", "record"},
    "choices": {"decode", "record"},
    "grammar": {"decode", "record"},
}
OPENAI = {
    "max_new_tokens": ("max_tokens", "max_completion_tokens"),
    "ignore_eos": ("ignore_eos",),
    "stop": ("stop",),
    "n": ("n",),
    "json_schema": ("guided_json",),  # vLLM's names
    "regex": ("guided_regex",),
    "choices": ("guided_choice",),
    "grammar": ("guided_grammar",),
}
# A good value of each field, as JSON writes it, and as the request holds it.
GOOD = {
    "max_new_tokens": (3, 3),
    "ignore_eos": (True, True),
    "stop": (["."], (".",)),
    "chat": (True, True),
    "system_prompt": ("Be brief.", "Be brief."),
    "trusted_chat": (True, True),
    "n": (2, 2),
    "priority": (2, 2.0),
    "logprobs": (3, 3),
    "prompt_logprobs": (True, True),
    "json_schema": ('{"type": "string"}', '{"type": "string"}'),
    "regex": ("[a-z]+", "[a-z]+"),
    "choices": (["yes", "no"], ("yes", "no")),
    "grammar": ('start: "a" | "b"', 'start: "a" | "b"'),
}
FLAGS = {
    "max_new_tokens": (["--max-new-tokens", "3"], 3),
    "ignore_eos": (["--ignore-eos"], True),
    "stop": (["--stop", ".", "--stop", "!"], [".", "!"]),
    "chat": (["--chat"], True),
    "system_prompt": (["--system", "Be brief."], "Be brief."),
    "n": (["-n", "2"], 2),
}


@pytest.fixture(scope="module")
def tiny(tiny_hf_dir):
    return etjax.load_model(tiny_hf_dir("llama"))


def _record(tiny, config: RunConfig, **fields) -> object:
    return parse_record(json.dumps({"id": "r", "prompt": "The river", **fields}), 1, tiny, config)


def _openai(tiny, config: RunConfig, **body) -> object:
    messages = [{"role": "user", "content": "The river"}]
    line = {"custom_id": "r", "url": openai_format.CHAT, "body": {"messages": messages, **body}}
    return parse_record(json.dumps(line), 1, tiny, config)


def test_the_table_holds_each_field_at_the_doors_this_test_names():
    assert set(FIELDS) == set(DOORS) == set(GOOD)
    assert {name: set(row.doors) for name, row in FIELDS.items()} == DOORS
    assert {name: row.openai for name, row in FIELDS.items() if row.openai} == OPENAI
    # An OpenAI line is read as a record: its fields must be open to records.
    assert all("record" in FIELDS[name].doors for name in OPENAI)


def test_decode_writes_out_its_fields_with_the_table_s_defaults_and_help():
    parameters = inspect.signature(etjax.decode).parameters
    for name, row in FIELDS.items():
        if "decode" not in row.doors:
            assert name not in parameters
            continue
        parameter = parameters[name]
        assert parameter.kind is inspect.Parameter.KEYWORD_ONLY
        assert row.read(parameter.default) == row.default  # decode's None is no stop: ()
        # help(decode) shows the table's description (the words, whatever the wrapping).
        assert " ".join(row.help.split()) in " ".join(etjax.decode.__doc__.split())


@pytest.mark.parametrize("name", sorted(DOORS))
def test_a_field_is_taken_by_its_doors_and_refused_by_name_at_the_others(tiny, tmp_path, name):
    written, held = GOOD[name]
    config = RunConfig("test")
    # A batch record.
    rec = _record(tiny, config, **{name: written})
    if "record" in DOORS[name]:
        assert rec.error is None, rec.error
        if hasattr(rec.settings, name):
            assert getattr(rec.settings, name) == held
        if name in ("n", "priority"):
            assert getattr(rec, name) == held
    else:
        assert rec.error.startswith(f"line 1: unknown field {name!r}; allowed: ")
    # An OpenAI batch line, by each of its names, and refused by the etjax name otherwise.
    for body_name in OPENAI.get(name, ()):
        rec = _openai(tiny, config, **{body_name: written})
        assert rec.error is None, rec.error
        assert (rec.n if name == "n" else getattr(rec.settings, name)) == held
    if name == "logprobs":  # OpenAI's logprobs is a switch; the k is its top_logprobs
        rec = _openai(tiny, config, logprobs=True, top_logprobs=written)
        assert rec.error is None, rec.error
        assert rec.settings.logprobs == held
        rec = _openai(tiny, config, logprobs=written)
        assert rec.error == f"line 1: body.logprobs={written!r}; must be true or false"
    elif name not in ("n", "stop", "ignore_eos"):  # the fields whose OpenAI name is their own
        rec = _openai(tiny, config, **{name: written})
        assert rec.error.startswith(f"line 1: body.{name} is not supported; allowed: ")
    # A run config's [request] table.
    path = tmp_path / "c.toml"
    path.write_text(f"[request]\n{name} = {json.dumps(written)}\n")
    if "toml" in DOORS[name]:
        assert getattr(load_run_config(path).request, name) == held
    else:
        with pytest.raises(ConfigError, match=rf"\[request\] unknown key {name!r}"):
            load_run_config(path)
    # An `etjax generate` flag.
    parser = _parser()
    if "cli" in DOORS[name]:
        flags, parsed = FLAGS[name]
        assert getattr(parser.parse_args(["generate", "x", *flags]), name) == parsed
    else:
        assert name not in FLAGS
        with pytest.raises(SystemExit):
            parser.parse_args(["generate", "x", "--" + name.replace("_", "-"), str(written)])
    # A decode() keyword: refused before any model loads.
    if "decode" not in DOORS[name]:
        with pytest.raises(RequestError, match=f"^{name} is not a decode\\(\\) keyword"):
            etjax.decode("x", model=str(tmp_path / "missing"), **{name: written})


# A bad value, the flags that give it, and the message every door gives it.
BAD = [
    (
        "max_new_tokens",
        0,
        ["--max-new-tokens", "0"],
        "max_new_tokens=0; must be a positive integer",
    ),
    ("n", 0, ["-n", "0"], "n=0; must be an integer from 1 to 128"),
    (
        "stop",
        [""],
        ["--stop", ""],
        "stop=['']; must be a non-empty string or a list of non-empty strings",
    ),
    ("priority", "high", None, "priority='high'; must be a finite number"),
    ("system_prompt", 5, None, "system_prompt=5; must be a string or None"),
    ("logprobs", 21, None, "logprobs=21; must be an integer from 0 to 20"),
    ("logprobs", -1, None, "logprobs=-1; must be an integer from 0 to 20"),
    ("logprobs", "x", None, "logprobs='x'; must be an integer from 0 to 20"),
    (
        "json_schema",
        {"type": "foo"},
        None,
        "json_schema={'type': 'foo'}; must be a valid JSON schema (an object, or its JSON "
        "text) (Invalid type: foo)",
    ),
    (
        "regex",
        "((",
        None,
        "regex='(('; must be a valid regular expression (at 1(8): invalid regex \"((\" (in "
        "regex): regex parse error: (( ^ error: unclosed group 1 | start: /((/ ^)",
    ),
    ("choices", [], None, "choices=[]; must be a non-empty list of non-empty strings"),
]


@pytest.mark.parametrize("name, value, flags, message", BAD, ids=[f"{b[0]}={b[1]!r}" for b in BAD])
def test_a_bad_value_is_one_error_naming_the_field_at_every_door(
    tiny, tmp_path, capsys, name, value, flags, message
):
    missing = str(tmp_path / "missing")  # no model loads before the settings are checked
    if "decode" in DOORS[name]:
        with pytest.raises(FieldError) as refused:
            etjax.decode("x", model=missing, **{name: value})
        assert str(refused.value) == message
        assert (refused.value.field, refused.value.value) == (name, value)
    json_message = message.replace("or None", "or null")  # as JSON spells it
    rec = _record(tiny, RunConfig("test"), **{name: value})
    assert rec.error == f"line 1: {json_message}"
    for body_name in OPENAI.get(name, ()):
        assert _openai(tiny, RunConfig("test"), **{body_name: value}).error == rec.error
    # A value of the wrong TOML type is refused by the loader's type check before this one
    # (tests/test_run_config.py); values of the right type meet the field's own check.
    if "toml" in DOORS[name] and name in ("max_new_tokens", "stop"):
        path = tmp_path / "c.toml"
        path.write_text(f"[request]\n{name} = {json.dumps(value)}\n")
        with pytest.raises(ConfigError) as refused:
            load_run_config(path)
        assert str(refused.value) == f"{path}: [request] {message}"
    if flags is not None:
        assert main(["generate", "x", "--model", missing, *flags]) == 2
        err = capsys.readouterr().err
        assert err == f"etjax: error: {message}\n"


def test_a_switch_is_spelled_as_each_door_s_language_spells_it(tiny, tmp_path):
    with pytest.raises(FieldError, match=r"^ignore_eos='no'; must be True or False$"):
        etjax.decode("x", model=str(tmp_path / "missing"), ignore_eos="no")
    rec = _record(tiny, RunConfig("test"), ignore_eos="no")
    assert rec.error == "line 1: ignore_eos='no'; must be true or false"
    # The classes holding the fields check them when made, as SamplerSettings does.
    with pytest.raises(FieldError, match=r"^ignore_eos=1; must be True or False$"):
        RequestSettings(ignore_eos=1)
    with pytest.raises(FieldError, match=r"^chat=1; must be True or False$"):
        dataclasses.replace(load_run_config("default").request, chat=1)


def test_the_device_ends_a_row_at_eos_and_the_host_reports_it(tiny, monkeypatch):
    # Greedy tokens past any eos, then one of them made the eos id: the row ends at its
    # first occurrence (that token included), unless eos is ignored.
    (free,) = etjax.decode("The river", model=tiny, max_new_tokens=8, ignore_eos=True)
    assert free.finish_reason == "length" and len(free.token_ids) == 8
    at = 3
    eos = free.token_ids[at]
    first = free.token_ids.index(eos)
    monkeypatch.setattr(tiny.tokenizer, "_eos_token_ids", (eos,))
    (ended,) = etjax.decode("The river", model=tiny, max_new_tokens=8)
    assert ended.finish_reason == "eos"
    assert ended.token_ids == free.token_ids[: first + 1]
    (ignored,) = etjax.decode("The river", model=tiny, max_new_tokens=8, ignore_eos=True)
    assert ignored.token_ids == free.token_ids and ignored.finish_reason == "length"


def test_openai_body_fields_are_mapped_ignored_or_refused_by_name(tiny):
    config = RunConfig("test")
    plain = _openai(tiny, config)
    rec = _openai(tiny, config, top_k=5, min_p=0.1, repetition_penalty=1.2, stream=False)
    assert rec.error is None, rec.error
    sampler = rec.settings.sampler
    assert (sampler.top_k, sampler.min_p, sampler.repetition_penalty) == (5, 0.1, 1.2)
    assert _openai(tiny, config, top_k=-1).settings.sampler.top_k == 0  # vLLM's "off"
    # The sampler's own check, by the record's name.
    assert _openai(tiny, config, top_k=-3).error == "line 1: top_k=-3; must be an int >= 0"
    # Accounting metadata: taken, and nothing about the request changes.
    quiet = _openai(tiny, config, user="u-1", metadata={"batch": "7"}, store=False)
    assert quiet.error is None and quiet.settings == plain.settings
    assert quiet.fingerprint == plain.fingerprint
    refused = {
        "tools": "etjax generates text only; it does not call tools or functions",
        "logit_bias": "etjax's sampler has no per-token logit bias",
        "min_tokens": "etjax has no minimum length",
    }
    for name, why in refused.items():
        error = _openai(tiny, config, **{name: [1]}).error
        assert error.startswith(f"line 1: body.{name} is not supported: {why}"), error
    assert _openai(tiny, config, stream=True).error.startswith("line 1: body.stream=True")
    error = _openai(tiny, config, frobnicate=1).error
    assert error.startswith("line 1: body.frobnicate is not supported; allowed: ")


def test_openai_response_format_is_a_json_schema_constraint(tiny):
    config = RunConfig("test")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    formats = {
        "json_object": ({"type": "json_object"}, '{"type": "object"}'),
        "json_schema": (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}},
            json.dumps(schema),
        ),
        "text": ({"type": "text"}, None),
    }
    for given, held in formats.values():
        rec = _openai(tiny, config, response_format=given)
        assert rec.error is None, rec.error
        assert rec.settings.json_schema == held
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}
    assert _openai(tiny, config, response_format=bad).error == (
        "line 1: body.response_format.json_schema.schema: must be a valid JSON schema (an "
        "object, or its JSON text) (Invalid type: foo)"
    )
    both = _openai(tiny, config, response_format={"type": "json_object"}, guided_regex="a")
    assert both.error == "line 1: body.response_format and body.guided_regex are both given"
    two = _record(tiny, config, regex="a+", choices=["a"])
    assert two.error == "line 1: regex and choices are both given; a request takes one"
