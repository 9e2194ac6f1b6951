"""The minimum-advancement guarantee of etjax/engine/scheduler.py, tested on its own terms:
any arrivals and departures of resident sequences up to the R * B cap, any policy ranking,
and no resident sequence ever goes more than R rounds without running."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from etjax.engine.scheduler import forced_count, pick_batch
from etjax.engine.sequence import Sequence, Status
from etjax.runtime.options import RequestSettings
from tests.hypothesis_profiles import examples


class _Adversary:
    """A policy whose ranking is drawn per round: whatever it prefers, the bound must hold."""

    name = "adversary"

    def __init__(self, ranks: dict[int, float]) -> None:
        self.ranks = ranks

    def run_priority(self, seq: Sequence, round_: int) -> float:
        return self.ranks.get(seq.order, 0.0)


@settings(max_examples=examples(300))
@given(
    batch=st.integers(1, 4),
    rounds=st.integers(1, 5),
    # Per round: how many sequences become resident (capped by free rows), which residents
    # leave (by index), and the policy's ranks.
    script=st.lists(
        st.tuples(
            st.integers(0, 8),
            st.lists(st.integers(0, 20), max_size=3),
            st.lists(st.floats(-1, 1), min_size=20, max_size=20),
        ),
        min_size=1,
        max_size=40,
    ),
)
def test_every_resident_sequence_runs_within_min_advance_rounds(batch, rounds, script):
    cap = batch * rounds
    resident: list[Sequence] = []
    made = 0
    for round_, (arrivals, leavers, ranks) in enumerate(script):
        for i in sorted(set(leavers), reverse=True):
            if i < len(resident):
                resident.pop(i)
        for _ in range(min(arrivals, cap - len(resident))):
            seq = Sequence(order=made, prompt=[1], settings=RequestSettings(1))
            seq.status, seq.row = Status.RUNNING, made
            seq.last_run_round = round_  # became resident this round
            resident.append(seq)
            made += 1
        policy = _Adversary({s.order: ranks[s.order % 20] for s in resident})
        chosen = pick_batch(resident, policy, round_, batch, rounds)
        assert len(chosen) == min(batch, len(resident))
        for seq in chosen:
            seq.last_run_round = round_
        for seq in resident:
            assert round_ + 1 - seq.last_run_round <= rounds, "a deadline will be missed"


def test_sequences_resident_in_the_same_round_are_started_before_their_deadline():
    # B = 1, R = 3: three sequences that became resident in round 0 share the deadline 3, so
    # one must run in each of rounds 1, 2 and 3 ("overdue first" would wait for round 3 and
    # then serve only one of them).
    assert forced_count([0, 0, 0], 0, 1, 3) == 0  # round 0 is free for the policy
    assert forced_count([0, 0, 0], 1, 1, 3) == 1  # 3 due by round 3, 2 rounds left after this
    assert forced_count([1, 0, 0], 2, 1, 3) == 1  # 2 due by round 3, 1 round left after this
    assert forced_count([1, 2, 0], 3, 1, 3) == 1  # the last one is due now
    assert forced_count([1, 2], 3, 1, 3) == 0  # deadlines 4 and 5: two rounds for two
