"""Shape buckets (etjax/buckets.py), by hand."""

from __future__ import annotations

import pytest

from etjax.buckets import cut_to_bucket
from etjax.request_fields import RequestSettings


@pytest.mark.parametrize(
    "others,chunk,want",
    [
        (0, 136, 128),  # 256 padded -> 128 + 8: 136 + 16 token computes against 256
        (0, 300, 256),  # 512 -> 256 + 64 (44 padded): 320 + 16 against 512
        (0, 400, 400),  # 512 -> 256 + 256 (144 padded): no cheaper
        (0, 9, 9),  # 16 -> 8 + 8: the fixed part of a second step costs more
        (4, 132, 124),  # decoding rows count in the step: 4 + 124 = 128
        (130, 6, 6),  # the others alone fill past 128: nothing to cut
        (0, 128, 128),  # a bucket exactly
    ],
)
def test_a_chunk_is_cut_where_two_steps_cost_less_than_the_padding(others, chunk, want):
    assert cut_to_bucket(others, chunk, fixed_tokens=16) == want


def test_no_cut_without_a_fixed_cost():
    assert cut_to_bucket(0, 136, None) == 136


def test_the_engine_prefills_136_tokens_as_128_then_8_where_steps_cost_their_tokens():
    # The mock engine priced as a CPU (16 tokens' worth a step): a lone 136-token prompt's
    # prefill runs as steps of 128 and 8 tokens; beside a decoding row a chunk stays whole;
    # the tokens are the mock's, by hand, either way.
    from tests.engine_mock import mock_engine, token_of

    engine, backend = mock_engine(batch=2, pages=512, prefill_chunk=512, step_fixed_tokens=16.0)
    steps = []
    mixed = backend.mixed

    def counted(rows, pages, lengths, budgets, jobs, drafts=None):
        steps.append((len(rows), [len(j.tokens) for j in jobs]))
        return mixed(rows, pages, lengths, budgets, jobs, drafts)

    backend.mixed = counted
    settings = RequestSettings(max_new_tokens=4, ignore_eos=True)
    (out,) = engine.generate([[7] + [5] * 135], [settings])
    assert steps == [(0, [128]), (0, [8])]
    assert out.token_ids == [token_of(7, i) for i in range(4)]
    steps.clear()
    first = engine.submit([8, 5, 5], RequestSettings(max_new_tokens=40, ignore_eos=True))
    engine.step()  # its prefill; it decodes from the next round on
    engine.submit([9] + [5] * 135, settings)
    engine.run_until_idle()
    assert (1, [136]) in steps
    assert first.result().token_ids == [token_of(8, i) for i in range(40)]
