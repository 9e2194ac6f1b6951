"""What forced-token drafting (etjax/drafting/forced.py) rests on, on the host alone: each
token the matcher calls forced is the one token the grammar's own mask allows at that point,
over hypothesis-drawn JSON schemas, so a forced run is a run of zero-entropy steps whose drafts
the masked draw always accepts. (That drafting them changes no output is checked end to end in
tests/test_constraints.py, against the same requests without drafting.)
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from etjax.constraints import matcher
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
