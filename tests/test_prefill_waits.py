"""Prompt chunks that wait for a decode burst (etjax/engine/policies.py, "A decode burst or a
prompt chunk"; etjax/engine/scheduler.py, `prefill_waits`): the entropic policy's rule on
hand-built host records, the scheduler's bound, and the engine on the mock device."""

from __future__ import annotations

import pytest

from etjax.engine.policies import make_policy
from etjax.engine.scheduler import prefill_waits
from etjax.engine.sequence import Sequence
from etjax.runtime.options import RequestSettings
from tests.engine_mock import mock_engine as _engine
from tests.engine_mock import token_of

K = 8  # steps a burst


def _decoding(order: int, entropies: list[float], max_new: int) -> Sequence:
    # A row that generated len(entropies) tokens whose entropy signal is `entropies`.
    seq = Sequence(order=order, prompt=[1, 2, 3], settings=RequestSettings(max_new))
    seq.output.token_ids = [7] * len(entropies)
    seq.output.calibrated_entropy = list(entropies)
    return seq


def _prefilling(order: int, length: int, prefilled: int) -> Sequence:
    seq = Sequence(order=order, prompt=[5] * length, settings=RequestSettings(4))
    seq.context, seq.prefilled = list(seq.prompt), prefilled
    return seq


def _entropic():
    # pass_fixed_tokens F = 5: a step of n tokens costs 5 + n token computes.
    return make_policy("entropic", 1000.0, 1.0, 4, 16, pass_fixed_tokens=5.0)


def test_entropic_chunks_wait_when_a_burst_resolves_more_per_cost():
    # Two rows, each with its entropy falling 0.5 nats a token (d = 0.5) and 100 tokens left:
    # a burst resolves 2 * 0.5 * 8 = 8 nats for 8 * (5 + 2) = 56, 0.143 a unit; the ragged
    # step 2 * 0.5 = 1 nat for 5 + 2 + 64 = 71, 0.014 a unit. The 64-token chunk (of 1,000
    # left) waits.
    batch = [_decoding(0, [3.0, 2.5, 2.0], 103), _decoding(1, [3.0, 2.5, 2.0], 103)]
    doc = _prefilling(2, 1000, 0)
    assert _entropic().prefill_yields(batch, [(doc, 64)], K)
    assert not make_policy("fcfs", 1000.0, 1.0, 4, 16).prefill_yields(batch, [(doc, 64)], K)
    assert not make_policy("priority", 1000.0, 1.0, 4, 16).prefill_yields(batch, [(doc, 64)], K)


def test_entropic_chunks_run_when_one_ends_its_prompt_or_the_rows_resolve_nothing():
    batch = [_decoding(0, [3.0, 2.5, 2.0], 103), _decoding(1, [3.0, 2.5, 2.0], 103)]
    doc = _prefilling(2, 1000, 0)
    policy = _entropic()
    # The chunk reaches the prompt's end: the round draws a first token; it never waits.
    assert not policy.prefill_yields(batch, [(_prefilling(2, 100, 36), 64)], K)
    # Flat entropy (d = 0): the burst resolves nothing a ragged step would not.
    flat = [_decoding(0, [2.0, 2.0, 2.0], 103), _decoding(1, [2.0, 2.0, 2.0], 103)]
    assert not policy.prefill_yields(flat, [(doc, 64)], K)
    # Fewer than two rows per waiting prompt: one row, or two rows and two prompts.
    assert not policy.prefill_yields(batch[:1], [(doc, 64)], K)
    assert not policy.prefill_yields(batch, [(doc, 64), (_prefilling(3, 1000, 0), 64)], K)
    assert not policy.prefill_yields([], [(doc, 64)], K)


@pytest.mark.parametrize("chunk, waits", [(49, False), (50, True)])
def test_entropic_rows_about_to_finish_let_a_short_chunk_run(chunk, waits):
    # Two rows with d = 0.5 and 1 token left each: a burst gives them 2 tokens for
    # 8 * (5 + 2) = 56, the ragged step 2 tokens for 5 + 2 + chunk. The burst is dearer
    # unless the chunk costs more than 49 token computes.
    batch = [_decoding(0, [3.0, 2.5, 2.0], 4), _decoding(1, [3.0, 2.5, 2.0], 4)]
    doc = _prefilling(2, 1000, 0)
    assert _entropic().prefill_yields(batch, [(doc, chunk)], K) is waits


def test_scheduler_bounds_the_wait_by_rounds_and_by_the_chunk_round_s_time():
    batch = [_decoding(0, [3.0, 2.5, 2.0], 103), _decoding(1, [3.0, 2.5, 2.0], 103)]
    chunks = [(_prefilling(2, 1000, 0), 64)]
    policy = _entropic()

    def waits(rounds: int, seconds: float, chunk_seconds: float, r: int = 4) -> bool:
        return prefill_waits(policy, batch, chunks, K, rounds, seconds, chunk_seconds, r)

    assert waits(0, 0.0, 2.0)  # the policy prefers the burst, nothing waited yet
    assert waits(2, 1.9, 2.0)  # 3 rounds in a row and 1.9 s of bursts: still within
    assert not waits(3, 0.5, 2.0)  # R - 1 = 3 rounds waited: this round runs the chunks
    assert not waits(1, 2.0, 2.0)  # the bursts took as long as the chunk round did
    assert not waits(0, 0.0, 0.0)  # no chunk round timed yet: the first never waits
    assert not waits(0, 0.0, 2.0, r=1)  # R = 1: chunks every round
    assert not prefill_waits(policy, [], chunks, K, 0, 0.0, 2.0, 4)


def _costed(backend, engine, chunk: float, burst: float) -> list[str]:
    # The engine's clock advances by a cost per device call: `chunk` for a ragged step with
    # prompt chunks, `burst` for a decode burst. Returns the calls' kinds as they run.
    kinds, now = [], [0.0]
    decode, mixed = backend.decode, backend.mixed

    def costed_decode(*args, **kwargs):
        kinds.append("burst")
        now[0] += burst
        return decode(*args, **kwargs)

    def costed_mixed(rows, pages, lengths, budgets, jobs, drafts=None):
        kinds.append("chunk" if jobs else "ragged")
        now[0] += chunk
        return mixed(rows, pages, lengths, budgets, jobs, drafts)

    backend.decode, backend.mixed = costed_decode, costed_mixed
    engine.clock = lambda: now[0]
    return kinds


@pytest.mark.parametrize("policy", ["fcfs", "entropic"])
def test_short_requests_burst_while_a_long_prompt_prefills(policy):
    # Requests 1 and 3 (4-token prompts, 24 new tokens, entropy falling 0.1 a token) and
    # request 2 (80-token prompt, 4 new) arrive together; chunks of 8 tokens, two prompts a
    # round, bursts of K = 2 steps; a chunk round costs 10 on the clock and a burst 6; R = 4.
    # Round 0 prefills 1 and 3. FCFS then runs 2's ten chunks in rounds 1-10 (1 and 3 get a
    # token in each) and bursts all three from round 11: 1 and 3 finish in round 17. Under
    # the entropic policy 2's chunks wait while the bursts run in their place took less
    # than the chunk round (two bursts, 12 >= 10; the rounds' bound, three, does not bind):
    # burst, burst, chunk, ... until 1 and 3 finish in round 14; 2's last five chunks then
    # run alone (the last, ending its prompt, would never wait).
    engine, backend = _engine(policy, batch=3, resident=3, entropy={1: (5.0, 0.1), 3: (5.0, 0.1)})
    kinds = _costed(backend, engine, chunk=10.0, burst=6.0)
    short = engine.submit([1] + [5] * 3, RequestSettings(24))
    other = engine.submit([3] + [5] * 3, RequestSettings(24))
    long = engine.submit([2] + [5] * 79, RequestSettings(4))
    engine.run_until_idle()
    for r, handle in ((1, short), (3, other)):
        assert handle.result().token_ids == [token_of(r, i) for i in range(24)]
    assert long.result().token_ids == [token_of(2, i) for i in range(4)]
    if policy == "fcfs":
        assert kinds == ["chunk"] * 11 + ["burst"] * 7
        assert short.sequence.finish_round == other.sequence.finish_round == 17
    else:
        assert kinds == ["chunk"] + ["burst", "burst", "chunk"] * 5 + ["chunk"] * 5 + ["burst"] * 2
        assert short.sequence.finish_round == other.sequence.finish_round == 14
