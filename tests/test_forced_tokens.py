"""What forced-token drafting (etjax/drafting/forced.py) rests on, on the host alone: each
token the matcher calls forced is the one token the grammar's own mask allows at that point,
over hypothesis-drawn JSON schemas, so a forced run is a run of zero-entropy steps whose drafts
the masked draw always accepts; and a constrained row's lookup draft is cut exactly where the
grammar's masks stop allowing it. (That drafting changes no output is checked end to end in
tests/test_constraints.py, against the same requests without drafting.)
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from etjax.constraints import matcher
from etjax.drafting import lookup_within_grammar
from tests.hypothesis_profiles import examples
from tests.json_schemas import SCHEMAS


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return smollm2.tokenizer, smollm2.config.vocab_size


@settings(max_examples=examples(25))
@given(schema=SCHEMAS, pick=st.randoms(use_true_random=False))
def test_forced_tokens_are_the_only_tokens_their_masks_allow(tokenizer, schema, pick):
    # Walk the grammar: where the matcher names forced tokens, each must be the single token
    # its mask allows once the ones before it are taken; elsewhere take any allowed token.
    tok, vocab = tokenizer
    gid = matcher.register("json_schema", json.dumps(schema), tok, vocab)
    row = matcher._registry[gid]
    eos = set(tok.eos_token_ids)
    try:
        for _ in range(40):
            forced = matcher.forced_tokens(gid)
            for token in forced:
                allowed = np.flatnonzero(
                    np.unpackbits(row.mask().view(np.uint8), bitorder="little")
                )
                assert allowed.tolist() == [token]
                row.consume(row.consumed, token)
            allowed = np.flatnonzero(np.unpackbits(row.mask().view(np.uint8), bitorder="little"))
            choices = [t for t in allowed.tolist() if t not in eos]
            if not choices:
                break
            row.consume(row.consumed, pick.choice(choices))
    finally:
        matcher.release(gid)


def test_a_constrained_rows_lookup_draft_is_cut_where_its_masks_refuse_it(tokenizer):
    # The truth is the masks themselves: walking a copy of the matcher token by token, the
    # draft keeps exactly the tokens each mask allows, and never consumes from the row's own.
    tok, vocab = tokenizer
    regex = "[A-Z][a-z]+, [0-9]{4}"
    gid = matcher.register("regex", regex, tok, vocab)
    row = matcher._registry[gid]
    try:
        lookup = tok.encode("Paris, 1998 was a year")  # the prediction, then the drafts
        allowed_run = 0
        walker = row.matcher.deep_copy()
        for token in lookup:
            bits = np.unpackbits(
                np.frombuffer(walker.compute_bitmask(), np.uint8), bitorder="little"
            )
            if not bits[token]:
                break
            walker.consume_token(token)
            allowed_run += 1
        assert 2 <= allowed_run < len(lookup)  # "Paris, 1998" passes, " was" does not
        assert lookup_within_grammar(gid, lookup) == lookup[1:allowed_run]
        assert row.consumed == 0 and matcher.valid_prefix(gid, lookup) == allowed_run
        # A prediction the grammar refuses (lower case first) drafts nothing.
        assert lookup_within_grammar(gid, tok.encode("paris, 1998")) == []
    finally:
        matcher.release(gid)
