"""Constrained output (`json_schema`, `regex`, `choices`, `grammar`) on SmolLM2, all in one
engine: every output that ends by itself parses and validates (`jsonschema`, the regex, the
grammar's language; and over hypothesis-drawn schemas), one cut by max_new_tokens says so,
the trace's entropy is the masked distribution's, an unconstrained row beside the constrained
ones decodes exactly as transformers' greedy search does, and drafting the grammar's forced
tokens (etjax/drafting/forced.py), and a constrained row's lookup drafts cut to its grammar,
gives the tokens of the same requests with each token a step of its own (greedy and a seeded
row)."""

from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from etjax.constraints import matcher
from etjax.drafting import SpeculationConfig
from etjax.engine_build import RequestSettings, RuntimeOptions, generate_ids
from etjax.sampling import SamplerSettings
from tests.greedy_reference import greedy_choices
from tests.hypothesis_profiles import examples
from tests.json_schemas import SCHEMAS as DRAWN_SCHEMAS

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "label": {
        "type": "object",
        "properties": {
            "sentiment": {"enum": ["positive", "negative", "neutral"]},
            "confidence": {"type": "integer", "minimum": 1, "maximum": 5},
        },
        "required": ["sentiment", "confidence"],
        "additionalProperties": False,
    },
    "tags": {
        "type": "array",
        "items": {"type": "string", "maxLength": 12},
        "minItems": 1,
        "maxItems": 3,
    },
}
# The regex row copies its prompt's text: its tokens are drafted by lookup, cut to the regex.
REGEX = r"[a-z ]{1,90}"
COPIED = "the river bank was wide and the water was cold and the boats were slow"
GRAMMAR = 'start: "The answer is " answer "."\nanswer: "yes" | "no"'  # Lark, as llguidance reads
CHOICES = ("yes", "no")
PLAIN_TOKENS = 8
SEEDED = SamplerSettings(temperature=0.9, top_p=0.95, seed=5)  # the "label" row's sampler
# Speculation on, forced runs drafted in every round that has one (a pass's fixed cost as an
# accelerator's: this CPU's gate would draft in fewer rounds), lookups where the next token
# is free.
DRAFTING = SpeculationConfig(enabled=True, pass_fixed_tokens=1000.0, measured_costs=False)

# Validity, etjax against itself, and 8 greedy tokens against transformers, over short prompts:
# the module compiles far more than it runs, so it compiles cheaply (tests/compile_level.py).
pytestmark = pytest.mark.compile_bound


def _chat(model, text: str) -> list[int]:
    # A short system turn in place of the template's default: every prompt fits one ragged
    # step (and no two start alike, which the prefix cache would serialise), so the prefill
    # compiles one program and no constrained row shares a step with a chunk.
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
    return model.tokenizer.encode_chat(messages, add_generation_prompt=True)


def _asks(smollm2):
    # Every row at once: three schemas, a regex, choices, a grammar, a schema cut short, and
    # an unconstrained row, greedy but for the seeded "label" row.
    asks = [
        ("person", "Give a famous scientist as JSON with name and age.", 24),
        ("label", "Label the sentiment of: 'I loved this film.'", 24),
        ("tags", "Three tags for a post about rivers, as a JSON list.", 24),
        ("regex", f"Repeat exactly: {COPIED}", 24),
        ("choices", "Is water wet? Answer yes or no.", 3),
        ("grammar", "Is the sea salty?", 8),
        ("cut", "Give a famous painter as JSON with name and age.", 4),
        ("plain", "The river bank was", PLAIN_TOKENS),
    ]
    settings = []
    for kind, _, new in asks:
        if kind in SCHEMAS:
            fields = {"json_schema": json.dumps(SCHEMAS[kind])}
        elif kind == "cut":
            fields = {"json_schema": json.dumps(SCHEMAS["person"])}
        elif kind == "regex":
            fields = {"regex": REGEX}

        elif kind == "choices":
            fields = {"choices": CHOICES}
        elif kind == "grammar":
            fields = {"grammar": GRAMMAR}
        else:
            fields = {"ignore_eos": True}
        if kind == "label":
            fields["sampler"] = SEEDED
        settings.append(RequestSettings(max_new_tokens=new, **fields))
    prompts = [_chat(smollm2, text) for _, text, _ in asks]
    return [kind for kind, _, _ in asks], prompts, settings


def _run(smollm2, speculation):
    kinds, prompts, settings = _asks(smollm2)
    options = RuntimeOptions(speculation=speculation)
    outs = generate_ids(
        smollm2.weights, smollm2.config, smollm2.tokenizer, prompts, settings, options
    )
    return {kind: (p, out) for kind, p, out in zip(kinds, prompts, outs, strict=True)}


@pytest.fixture(scope="module")
def runs(smollm2):
    return _run(smollm2, DRAFTING)


def test_constrained_outputs_parse_and_validate(runs):
    for name, schema in SCHEMAS.items():
        _, out = runs[name]
        assert out.finish_reason == "eos", (name, out.text)
        jsonschema.validate(json.loads(out.text), schema)
    _, out = runs["regex"]
    assert out.finish_reason == "eos" and re.fullmatch(REGEX, out.text), out.text
    _, out = runs["choices"]
    assert out.finish_reason == "eos" and out.text in CHOICES
    _, out = runs["grammar"]
    assert out.finish_reason == "eos"
    assert re.fullmatch(r"The answer is (yes|no)\.", out.text), out.text
    # Cut by max_new_tokens: said so, never an incomplete value called complete.
    _, out = runs["cut"]
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    assert matcher.live_count() == 0  # every request's matcher released


@settings(max_examples=examples(2))
@given(schemas=st.lists(DRAWN_SCHEMAS, min_size=8, max_size=8))
def test_drawn_schemas_give_valid_json_or_say_they_were_cut(smollm2, runs, schemas):
    # Eight drawn schemas in one engine (the `runs` engine's options, so its programs): an
    # output that ends by itself validates; one that does not says "length" at the limit.
    # Numbered first, so that no two prompts share a first page: the prefix cache would
    # prefill them one after the other, in steps of shapes no other test compiled; together
    # they take the `runs` engine's prefill program, as every later step takes its programs:
    # at most 31 tokens each, the eight fill the 256-token bucket as the `runs` prompts do
    # (a word more each, and they compiled a 512-token step).
    prompts = [
        _chat(smollm2, f"{i + 1}. Describe a place as JSON: {', '.join(s['required'])}.")
        for i, s in enumerate(schemas)
    ]
    settings_ = [RequestSettings(max_new_tokens=32, json_schema=json.dumps(s)) for s in schemas]
    options = RuntimeOptions(speculation=DRAFTING)
    outs = generate_ids(
        smollm2.weights, smollm2.config, smollm2.tokenizer, prompts, settings_, options
    )
    for schema, out in zip(schemas, outs, strict=True):
        if out.finish_reason == "eos":
            jsonschema.validate(json.loads(out.text), schema)
        else:
            assert out.finish_reason == "length" and len(out.token_ids) == 32, out.text
    assert sum(out.finish_reason == "eos" for out in outs) >= 6  # the limit is rarely reached
    assert matcher.live_count() == 0


def test_entropy_is_the_masked_distribution_s(runs):
    # Where the grammar allows one token (the schema's braces, quotes and keys) the masked
    # distribution has no entropy while the model's own has; unconstrained, they are one.
    _, out = runs["person"]
    forced = [h for h in out.entropy if h == 0.0]
    assert len(forced) >= 4
    assert any(raw > 0.1 for h, raw in zip(out.entropy, out.raw_entropy, strict=True) if h == 0.0)
    _, plain = runs["plain"]
    assert plain.entropy == plain.raw_entropy


def test_an_unconstrained_row_beside_constrained_ones_decodes_as_transformers(runs, hf_smollm2):
    # Greedy: each token is transformers' argmax after the prompt and the tokens before it
    # (one teacher-forced pass, the LM head only where it predicts them).
    prompt, out = runs["plain"]
    reference = greedy_choices(hf_smollm2, prompt, out.token_ids)
    assert len(out.token_ids) == PLAIN_TOKENS and out.token_ids == reference
    assert np.all(np.isfinite(out.logprob))


def test_drafting_changes_no_output(smollm2, runs):
    # The truth: the same requests with each token a step of its own (speculation on with no
    # room for a draft, forced runs off: the same burst programs). Same tokens, greedy and
    # seeded, same traces up to float rounding. The keys and braces came as forced drafts,
    # all accepted, and the regex row's copied text as lookup drafts cut to its regex, so fewer
    # passes than tokens.
    stepped = _run(smollm2, dataclasses.replace(DRAFTING, draft_budget=1, forced_tokens=False))
    for kind, (_, out) in runs.items():
        _, plain = stepped[kind]
        assert out.token_ids == plain.token_ids, (kind, out.text, plain.text)
        assert out.finish_reason == plain.finish_reason
        np.testing.assert_allclose(out.entropy, plain.entropy, atol=1e-4)
        np.testing.assert_allclose(out.raw_entropy, plain.raw_entropy, atol=1e-4)
        assert plain.metrics["passes_per_token"] == 1.0
    for kind in ("person", "label"):
        metrics = runs[kind][1].metrics
        assert metrics["drafted_tokens"] >= 2 and metrics["acceptance_rate"] == 1.0
        assert metrics["passes_per_token"] < 0.9
    _, copy = runs["regex"]
    assert copy.text == COPIED[: len(copy.text)] and len(copy.token_ids) >= 16, copy.text
    assert copy.metrics["drafted_tokens"] >= 4 and copy.metrics["passes_per_token"] < 0.8
