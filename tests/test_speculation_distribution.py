"""Verification keeps the sampler's distribution: chi-square tests of many seeded draws.

`accept_drafts` (etjax/runtime/verify.py) runs on 20,000 rows over a six-token vocabulary,
each row with its own seed, two drafted tokens per row. The tokens a row ends up with at the
two drafted positions (the accepted draft, or after a rejection the token its next step
draws) are tallied, and so are those of the plain path (`sample_rows`, `commit_tokens`) on
20,000 other seeds. The truths: for temperature and top-p, the distribution computed here
by hand (softmax at T, the nucleus renormalised); for the entropic controller, whose
temperature comes from its own state, the plain path's draws (a two-sample test). The seeds
are fixed, so each test passes or fails the same way every run; the threshold is p >= 0.001.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from etjax.calibration.signal import identity_params
from etjax.constraints.matcher import mask_words
from etjax.entropy.cost import CostModel
from etjax.entropy.state import initial_entropy_state
from etjax.model.weights import Weights
from etjax.runtime.commit import commit_tokens, sample_rows
from etjax.runtime.state import DecodeState
from etjax.runtime.verify import accept_drafts
from etjax.sampling import SamplerSettings
from etjax.sampling.sampler import initial_sampler_state
from etjax.sampling.settings import pack_sampler_params

ROWS = 20_000
# The distribution of the first drafted position, and of the second after the first draft.
FIRST = np.log(np.array([0.30, 0.26, 0.18, 0.12, 0.09, 0.05]))
SECOND = np.log(np.array([0.08, 0.40, 0.22, 0.15, 0.10, 0.05]))
DRAFTS = (1, 2)  # neither the likeliest token, nor rare
VOCAB = FIRST.size
# Hidden states are the logits themselves: an identity embedding as the tied head.
WEIGHTS = Weights(
    embed=jnp.eye(VOCAB, dtype=jnp.float32),
    layers=(),
    final_norm=jnp.ones(VOCAB, jnp.float32),
    lm_head=None,
)
COST = CostModel(1.0, 1.0, 1.0, 1.0, page_size=16)


def _rows(sampler: SamplerSettings, first_seed: int) -> DecodeState:
    params = pack_sampler_params(
        [dataclasses.replace(sampler, seed=first_seed + i) for i in range(ROWS)], ROWS
    )
    zeros = jnp.zeros(ROWS, jnp.float32)
    return DecodeState(
        logits=jnp.tile(jnp.asarray(FIRST, jnp.float32), (ROWS, 1)),
        lengths=jnp.full(ROWS, 20, jnp.int32),
        page_table=jnp.zeros((ROWS, 1), jnp.int32),
        active=jnp.ones(ROWS, bool),
        num_generated=jnp.ones(ROWS, jnp.int32),
        max_new_tokens=jnp.full(ROWS, 100, jnp.int32),
        stop_on_eos=jnp.zeros(ROWS, bool),
        eos_ids=jnp.zeros(1, jnp.int32),
        token_counts=jnp.zeros((ROWS, VOCAB), jnp.int32),
        in_prompt=jnp.zeros((ROWS, VOCAB), bool),
        logprobs=jnp.zeros(ROWS, jnp.int32),
        allowed=jnp.full((ROWS, mask_words(VOCAB)), 0xFFFFFFFF, jnp.uint32),
        grammar=jnp.full(ROWS, -1, jnp.int32),
        sampler=params,
        sampler_state=initial_sampler_state(params),
        entropy=initial_entropy_state(zeros, zeros + 0.0),
        calibration=identity_params(ROWS),
    )


@jax.jit
def _speculative(state: DecodeState) -> tuple[jax.Array, jax.Array]:
    # The tokens at the two drafted positions with verification; the second is meaningful
    # where the first is the first draft.
    drafts = jnp.tile(jnp.asarray(DRAFTS, jnp.int32), (ROWS, 1))
    hidden = jnp.broadcast_to(jnp.asarray(SECOND, jnp.float32), (ROWS, 2, VOCAB))
    after, out = accept_drafts(WEIGHTS, state, drafts, jnp.full(ROWS, 2), hidden, COST)
    accepted = out.emitted.sum(axis=0)
    next_token = sample_rows(after)[0]  # what the next step draws after a rejection
    first = jnp.where(accepted >= 1, DRAFTS[0], next_token)
    second = jnp.where(accepted >= 2, DRAFTS[1], next_token)
    return first, second


@jax.jit
def _plain(state: DecodeState) -> tuple[jax.Array, jax.Array]:
    # The same two positions drawn one step at a time (the second after the first draft).
    first, info, sampler_state = sample_rows(state)
    take = first == DRAFTS[0]
    second_logits = jnp.broadcast_to(jnp.asarray(SECOND, jnp.float32), state.logits.shape)
    zero = jnp.zeros_like(info.model_entropy)
    state, _ = commit_tokens(
        state, first, info, sampler_state, take, second_logits, zero + 1, zero, zero, zero
    )
    return first, sample_rows(state)[0]


def _tallies(first: jax.Array, second: jax.Array) -> tuple[np.ndarray, np.ndarray]:
    first, second = np.asarray(first), np.asarray(second)
    return (
        np.bincount(first, minlength=VOCAB),
        np.bincount(second[first == DRAFTS[0]], minlength=VOCAB),
    )


def _nucleus(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    # softmax(logits / T), then the smallest set of likeliest tokens holding top_p, renormalised.
    p = np.exp(logits / temperature)
    p /= p.sum()
    order = np.argsort(-p)
    before = np.cumsum(p[order]) - p[order]  # mass of the likelier tokens
    keep = np.zeros_like(p, bool)
    keep[order[before < top_p]] = True
    p = np.where(keep, p, 0.0)
    return p / p.sum()


def _fits(counts: np.ndarray, expected: np.ndarray) -> float:
    # Goodness of fit over the tokens the truth allows; any draw outside them fails outright.
    allowed = expected > 0
    assert counts[~allowed].sum() == 0, f"tokens drawn outside the support: {counts}"
    expected = expected[allowed] / expected.sum() * counts.sum()
    return stats.chisquare(counts[allowed], expected).pvalue


@pytest.mark.parametrize(
    "sampler", [SamplerSettings(temperature=0.8), SamplerSettings(temperature=1.2, top_p=0.8)]
)
def test_verified_drafts_keep_the_temperature_and_top_p_distribution(sampler):
    spec = _tallies(*_speculative(_rows(sampler, 0)))
    plain = _tallies(*_plain(_rows(sampler, ROWS)))
    truth = [_nucleus(x, sampler.temperature, sampler.top_p) for x in (FIRST, SECOND)]
    for counts in (*spec, *plain):
        assert counts.sum() > 2000
    for counts, expected in zip(spec + plain, truth + truth, strict=True):
        assert _fits(counts, expected) >= 1e-3, (counts, expected)


def test_verified_drafts_keep_the_entropic_controllers_distribution():
    sampler = SamplerSettings(sampler="entropic", target_entropy=1.0, temperature=1.0)
    spec = _tallies(*_speculative(_rows(sampler, 0)))
    plain = _tallies(*_plain(_rows(sampler, ROWS)))
    for a, b in zip(spec, plain, strict=True):
        seen = (a + b) > 0
        assert stats.chi2_contingency(np.stack([a[seen], b[seen]])).pvalue >= 1e-3, (a, b)
    # After one committed token the controller has moved the temperature off its start (1.0):
    # the second position is not drawn at T = 1, so the test sees the controller's state.
    second = spec[1] / spec[1].sum()
    assert not np.allclose(second, np.exp(SECOND), atol=0.02), second
