"""The speculation benchmark's bound (benchmarks/speculation_bound.py) on outputs whose best
rounds are counted by hand."""

from __future__ import annotations

from benchmarks.speculation_bound import fewest_burst_steps

PROMPT = list(range(3, 19))  # 16 distinct tokens


def _steps(output, ratio=2.0, counts=(1, 3, 7)):
    return fewest_burst_steps(PROMPT, output, lambda drafted, checked: ratio, 8, counts, 16, 1)


def test_a_copied_prompt_takes_two_verifying_steps():
    # The output repeats the prompt. Bursts: the first runs the pending first token and makes
    # 7 (position 8), the second 8 more: 16 steps. With drafts: the pending 3 matches the
    # prompt's start, the lookup drafts 4..10, all accepted (position 8, one step of cost 2);
    # then the tail 3..10 recurs, the row's own token is 11 and its 7 drafts 12..18: 4.
    copy = list(PROMPT)
    assert _steps(copy, counts=()) == 16
    assert _steps(copy) == 4
    # Where a verifying step costs more than the 8 burst steps it could replace, bursts.
    assert _steps(copy, ratio=9.0) == 16


def test_an_output_with_nothing_to_look_up_is_all_bursts():
    # No output token occurs before it: the lookup drafts nothing, 16 burst steps.
    assert _steps(list(range(50, 66))) == 16


def test_drafts_are_taken_up_to_the_first_wrong_one():
    # The copy leaves the prompt after 4..6: drafting 7 from the pending 3 accepts 3
    # (position 4, cost 2), or one burst reaches 8. From 4 (token 6, its tail 3..6 in the
    # prompt) the lookup predicts 7 where the output has 40: the row's own token only.
    # Cheapest: verify (2) to position 4, then a burst of 8 to 12, then 4 steps: 14; or a
    # burst to 8 and 8 steps: 16.
    output = [3, 4, 5, 6, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51]
    assert _steps(output) == 14
