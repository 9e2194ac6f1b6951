"""The scheduler's decisions as plain functions over host records: deterministic and testable
without a device.

Guarantees, whatever the policy:
- Minimum advancement: a resident sequence that has not run for `min_advance_rounds` rounds
  is put in the next batch before any other (oldest first). With at most
  `min_advance_rounds * batch_size` resident sequences, each runs at least once every
  `min_advance_rounds` rounds (`check_starvation_bound`). Each run produces up to
  `steps_per_sync` tokens, so a sequence that stays resident finishes within
  min_advance_rounds * ceil(max_new_tokens / steps_per_sync) rounds of becoming resident.
- Admission is strictly in the policy's order (aging lives in the admission keys): when the
  first waiting request does not fit, none behind it is admitted, so a stream of short
  prompts cannot starve a long one.
"""

from __future__ import annotations

from collections.abc import Iterable

from etjax.engine.policies import Policy
from etjax.engine.sequence import Sequence


def check_starvation_bound(resident_rows: int, batch_size: int, min_advance_rounds: int) -> None:
    """Refuse sizes under which the minimum-advancement guarantee cannot hold."""
    if resident_rows > batch_size * min_advance_rounds:
        raise ValueError(
            f"max_resident={resident_rows} exceeds max_batch_size * min_advance_rounds = "
            f"{batch_size} * {min_advance_rounds}: some resident sequence could wait longer "
            f"than {min_advance_rounds} rounds"
        )


def admission_order(waiting: Iterable[Sequence], policy: Policy, round_: int) -> list[Sequence]:
    """Waiting sequences in the order the policy admits them."""
    return sorted(waiting, key=lambda s: policy.admission_key(s, round_))


def pick_batch(
    running: list[Sequence], policy: Policy, round_: int, batch_size: int, min_advance_rounds: int
) -> list[Sequence]:
    """The resident sequences that decode this round: overdue ones first, then by priority."""
    overdue = [s for s in running if round_ - s.last_run_round >= min_advance_rounds]
    overdue.sort(key=lambda s: (s.last_run_round, s.order))
    chosen = overdue[:batch_size]
    taken = {id(s) for s in chosen}
    rest = [s for s in running if id(s) not in taken]
    rest.sort(key=lambda s: (-policy.run_priority(s, round_), s.order))
    chosen += rest[: batch_size - len(chosen)]
    return sorted(chosen, key=lambda s: s.row)


def preemption_victim(
    resident: list[Sequence], policy: Policy, round_: int, protect: Iterable[Sequence] = ()
) -> Sequence | None:
    """The resident sequence that yields its pages: the lowest priority, the latest arrival
    among equals; never one in `protect` unless nothing else is left."""
    protected = {id(s) for s in protect}
    for pool in ([s for s in resident if id(s) not in protected], list(resident)):
        if pool:
            return min(pool, key=lambda s: (policy.run_priority(s, round_), -s.order))
    return None
