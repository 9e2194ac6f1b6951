"""The least a batch-1 decode could cost with prompt lookup, whatever rule decides the rounds:
what a speculation target can be held against on the machine at hand.

Given the plain greedy output (the tokens any rule must commit, since verification keeps the
output), each round is either a decode burst of `steps` steps or one verifying step of the
lookup's drafts (`lookup_draft`, as the engine drafts them), of 1, 3 or 7 tokens (the counts
that fill a lone row's step buckets, rule.py `draft_caps`). A round's verdict is read off the
output: the drafts accepted are those that equal it. The cheapest sequence of rounds, in
burst steps of cost (a verifying step priced by `cost_ratio`, the gate's own figures), is
found by dynamic programming over the position reached: an oracle that knows where each
draft fails, so no rule with this lookup and these costs does better.

The engine's round semantics, as etjax/engine/engine.py runs them at batch 1: the first token
is drawn with the prompt and held pending; the first round runs it, so a first burst makes
`steps` - 1 new tokens and a first verifying step's drafts are the lookup itself; after
that a burst makes `steps` tokens (fewer at the end, which cost only the steps run) and a
verifying step the row's token plus its accepted drafts.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import numpy as np

from etjax.drafting import lookup_draft


def fewest_burst_steps(
    prompt: Sequence[int],
    output: Sequence[int],
    cost_ratio: Callable[[int, int], float],
    steps: int,
    draft_counts: Sequence[int],
    ngram_max: int,
    ngram_min: int,
) -> float:
    """The least cost, in burst steps, of committing `output` after `prompt` (the first
    output token drawn with the prompt): `cost_ratio(drafted, checked)` prices a verifying
    step of `drafted` drafts that checked `checked` positions against a burst step."""
    n = len(output)

    @functools.cache
    def best(position: int, pending: bool) -> float:
        # position: output tokens committed; the last one is pending where `pending`.
        if position >= n:
            return 0.0
        burst = min(steps, n - position + pending)
        options = [burst + best(position + burst - pending, False)]
        context = np.asarray([*prompt, *output[:position]], np.int32)
        own = 0 if pending else 1  # the lookup's first token predicts the row's own
        for count in draft_counts:
            drafts = lookup_draft(context, count + own, ngram_max, ngram_min)[own:]
            if not drafts:
                continue
            start = position if pending else position + 1
            accepted = 0
            while (
                accepted < len(drafts)
                and start + accepted < n
                and drafts[accepted] == output[start + accepted]
            ):
                accepted += 1
            advance = accepted + own
            if advance:
                checked = min(len(drafts), accepted + 1)
                cost = cost_ratio(len(drafts), checked)
                options.append(cost + best(position + advance, False))
        return min(options)

    return best(1, True)
