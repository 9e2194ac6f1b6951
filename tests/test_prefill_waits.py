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
    # Two rows, each with its entropy falling 0.5 nats a token (d = 0.5) and 10 tokens left:
    # a burst resolves 2 * 0.5 * 8 = 8 nats for 8 * (5 + 2) = 56, 0.143 a unit; the ragged
    # step 2 * 0.5 = 1 nat for 5 + 2 + 64 = 71, 0.014 a unit. The rows finish soon enough
    # (1 * 1,000 > 8 * 1 * 10 * (5 + 2) = 560): the 64-token chunk (of 1,000 left) waits.
    batch = [_decoding(0, [3.0, 2.5, 2.0], 13), _decoding(1, [3.0, 2.5, 2.0], 13)]
    doc = _prefilling(2, 1000, 0)
    assert _entropic().prefill_yields(batch, [(doc, 64)], K)
    assert not make_policy("fcfs", 1000.0, 1.0, 4, 16).prefill_yields(batch, [(doc, 64)], K)
    assert not make_policy("priority", 1000.0, 1.0, 4, 16).prefill_yields(batch, [(doc, 64)], K)


def test_entropic_chunks_run_when_one_ends_its_prompt_or_the_rows_resolve_nothing():
    batch = [_decoding(0, [3.0, 2.5, 2.0], 13), _decoding(1, [3.0, 2.5, 2.0], 13)]
    doc = _prefilling(2, 1000, 0)
    policy = _entropic()
    # The chunk reaches the prompt's end: the round draws a first token; it never waits.
    assert not policy.prefill_yields(batch, [(_prefilling(2, 100, 36), 64)], K)
    # Flat entropy (d = 0): the burst resolves nothing a ragged step would not.
    flat = [_decoding(0, [2.0, 2.0, 2.0], 13), _decoding(1, [2.0, 2.0, 2.0], 13)]
    assert not policy.prefill_yields(flat, [(doc, 64)], K)
    assert not policy.prefill_yields([], [(doc, 64)], K)


@pytest.mark.parametrize("chunk, waits", [(49, False), (50, True)])
def test_entropic_rows_about_to_finish_let_a_short_chunk_run(chunk, waits):
    # Two rows with d = 0.5 and 1 token left each: a burst gives them 2 tokens for
    # 8 * (5 + 2) = 56, the ragged step 2 tokens for 5 + 2 + chunk. The burst is dearer
    # unless the chunk costs more than 49 token computes.
    batch = [_decoding(0, [3.0, 2.5, 2.0], 4), _decoding(1, [3.0, 2.5, 2.0], 4)]
    doc = _prefilling(2, 1000, 0)
    assert _entropic().prefill_yields(batch, [(doc, chunk)], K) is waits


# Rows with d = 0.5 (3 tokens generated), F = 5, w = 8: finishing the j rows with the
# fewest tokens left (x_j) is worth the wait of m prompts with L tokens left to prefill iff
# j * L > 8 * m * x_j * (5 + rows).
@pytest.mark.parametrize(
    "left, prompts, waits",
    [
        ((35, 35), 1, True),  # j = 2: 2 * 1,000 = 2,000 > 8 * 35 * 7 = 1,960
        ((36, 36), 1, False),  # 2,000 < 2,016; j = 1: 1,000 < 1,008
        ((17, 40), 1, True),  # j = 1: 1,000 > 8 * 17 * 7 = 952
        ((20, 30), 1, True),  # j = 1: 1,000 < 1,120; j = 2: 2,000 > 1,680
        ((20, 40), 1, False),  # 1,000 < 1,120; 2,000 < 2,240
        ((35, 35), 2, True),  # L = 2,000, m = 2: j = 2: 4,000 > 8 * 2 * 35 * 7 = 3,920
        ((36, 36), 2, False),  # 4,000 < 4,032
        ((1, 1, 1, 100), 1, True),  # four rows: j = 1: 1,000 > 8 * 1 * 9 = 72
        ((100, 100, 100, 100), 1, False),  # j = 4: 4,000 < 8 * 100 * 9 = 7,200
    ],
)
def test_entropic_chunks_wait_only_for_rows_about_to_finish(left, prompts, waits):
    batch = [_decoding(i, [3.0, 2.5, 2.0], 3 + n) for i, n in enumerate(left)]
    chunks = [(_prefilling(10 + i, 1000, 0), 64) for i in range(prompts)]
    assert _entropic().prefill_yields(batch, chunks, K) is waits


def test_scheduler_bounds_the_wait_by_the_chunk_round_s_time():
    batch = [_decoding(0, [3.0, 2.5, 2.0], 13), _decoding(1, [3.0, 2.5, 2.0], 13)]
    chunks = [(_prefilling(2, 1000, 0), 64)]
    policy = _entropic()

    def waits(seconds: float, chunk_seconds: float) -> bool:
        return prefill_waits(policy, batch, chunks, K, seconds, chunk_seconds)

    assert waits(0.0, 2.0)  # the policy prefers the burst, nothing waited yet
    assert waits(5.9, 2.0)  # 5.9 s of bursts, under 3 times the chunk round's 2 s
    assert not waits(6.0, 2.0)  # the bursts took 3 times as long: this round runs the chunks
    assert not waits(0.0, 0.0)  # no chunk round timed yet: the first never waits
    assert not prefill_waits(policy, [], chunks, K, 0.0, 2.0)


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


def _short_and_long(policy: str, new_tokens: int, long_prompt: int):
    # Requests 1 and 3 (4-token prompts, `new_tokens` each, entropy falling 0.1 a token) and
    # request 2 (a `long_prompt`-token prompt, 4 new) arrive together; chunks of 8 tokens,
    # two prompts a round, bursts of K = 2 steps, F = 5, first tokens from a decode; a chunk
    # round costs 10 on the clock and a burst 6, so chunks wait for at most 5 bursts in a row.
    engine, backend = _engine(policy, batch=3, resident=3, entropy={1: (5.0, 0.1), 3: (5.0, 0.1)})
    kinds = _costed(backend, engine, chunk=10.0, burst=6.0)
    short = engine.submit([1] + [5] * 3, RequestSettings(new_tokens))
    other = engine.submit([3] + [5] * 3, RequestSettings(new_tokens))
    long = engine.submit([2] + [5] * (long_prompt - 1), RequestSettings(4))
    engine.run_until_idle()
    for r, handle in ((1, short), (3, other)):
        assert handle.result().token_ids == [token_of(r, i) for i in range(new_tokens)]
    assert long.result().token_ids == [token_of(2, i) for i in range(4)]
    assert short.sequence.finish_round == other.sequence.finish_round
    return kinds, short.sequence.finish_round


@pytest.mark.parametrize("policy", ["fcfs", "entropic"])
def test_short_requests_burst_while_a_long_prompt_prefills(policy):
    # Round 0 prefills 1 and 3. FCFS then runs 2's 20 chunks in rounds 1-20 (1 and 3 get a
    # token in each, finishing in round 4) and 2's two bursts. Entropic: the two rows need
    # x = 4 tokens and 2 has L = 160 left: 2 * 160 > 8 * 4 * (5 + 2) = 224, so 2's chunk
    # waits: a burst (prior drops: 2 * 0.5 * 2 = 2 nats for 14, against 1 for 15), and
    # again at x = 2 (0.4 nats for 14 against 0.2 for 15; 6 s of bursts < 30): 1 and 3
    # finish in round 2; 2's chunks then run alone.
    kinds, finished = _short_and_long(policy, new_tokens=4, long_prompt=160)
    if policy == "fcfs":
        assert kinds == ["chunk"] * 21 + ["burst"] * 2
        assert finished == 4
    else:
        assert kinds == ["chunk"] + ["burst"] * 2 + ["chunk"] * 20 + ["burst"] * 2
        assert finished == 2


def test_rows_that_outlive_the_prefill_do_not_hold_it_back():
    # Rows of 8 tokens beside a 64-token prompt: in round i (1-7) 2 * L = 2 * (72 - 8i) <
    # 8 * x * 7 = 56 * (9 - i), and round 8's chunk ends the prompt: the entropic run is
    # FCFS's, 2's 8 chunks in rounds 1-8 (the rows finish with them), then its 2 bursts.
    for policy in ("fcfs", "entropic"):
        kinds, finished = _short_and_long(policy, new_tokens=8, long_prompt=64)
        assert kinds == ["chunk"] * 9 + ["burst"] * 2
        assert finished == 8


def test_the_scheduler_ends_a_wait_at_three_chunk_rounds_of_bursts():
    # Rows of 16 tokens beside a 480-token prompt: the rows hold it (2 * 480 > 8 * 16 * 7)
    # through 5 bursts (30 s = 3 times the chunk round), then one chunk round (x = 6 -> 5,
    # L = 480 -> 472), then 3 bursts (5 -> 3 -> 1 -> 0); 2's 59 chunks then run alone.
    kinds, finished = _short_and_long("entropic", new_tokens=16, long_prompt=480)
    assert (
        kinds
        == ["chunk"] + ["burst"] * 5 + ["chunk"] + ["burst"] * 3 + ["chunk"] * 59 + ["burst"] * 2
    )
    assert finished == 9
