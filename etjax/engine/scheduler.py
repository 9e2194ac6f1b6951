"""The scheduler's decisions as plain functions over host records: deterministic and testable
without a device.

Guarantees, whatever the policy:
- Minimum advancement: with R = `min_advance_rounds`, B = `max_batch_size` and at most R * B
  resident sequences (`check_starvation_bound`), a resident sequence runs at least once in
  every R rounds: if it last ran (or became resident) in round r, it runs again by round r + R.
  A round counts once however many bursts it is split into (every batch member runs in it).
  A run produces one token in a round that also prefills (a ragged step) and up to
  `steps_per_sync` in a round that only decodes, so a sequence that stays resident finishes
  within R * max_new_tokens rounds of becoming resident, and within
  R * ceil(max_new_tokens / steps_per_sync) rounds while nothing else is prefilling.

  Why it holds (`forced_count`): give each resident sequence the deadline D = r + R. Running
  "overdue sequences first" is not enough: several sequences that became resident in the same
  round reach their deadline together, and a batch of B cannot serve more than B of them.
  Instead each round forces the m earliest deadlines into the batch, with m the largest
  excess of demand over supply in any window, m = max_d (#{D <= now + d} - B * d), d < R.
  Induction shows #{D <= now + d} <= B * (d + 1) for every window, every round: the forced
  picks cover each window's excess; a sequence that runs moves to now + R, outside every
  window of the next round; a new resident (D = now + R) only enters the widest window, whose
  count is all resident sequences, at most R * B. With d = 0 this says every deadline is met.
  The policy fills the rest of the batch as it likes.
- Admission is strictly in the policy's order (aging lives in the admission keys): when the
  first waiting request does not fit, none behind it is admitted, so a stream of short
  prompts cannot starve a long one. (A request whose next prompt page another request is
  prefilling steps aside until that page is written, a bounded wait: etjax/engine/engine.py.)
- Prompt chunks go to admitted sequences in the policy's prefill order; where it is not
  arrival order (entropic: fewest tokens left first), aging by the rounds since admission
  bounds how long any prefill waits.
- Prefill keeps a quarter of the time while it waits for bursts (`prefill_waits`). A
  policy may run a round's batch as a decode burst and leave the prompt chunks for a later
  round (policies.py, "A decode burst or a prompt chunk"); the scheduler lets the chunks
  wait only while the bursts run in their place since the last round with chunks took less
  than `WAIT_FACTOR` (3) times as long (on the engine's clock) as that round did. So while
  any sequence is prefilling, prefill gets about a quarter of the time or more (give or take
  the last burst, which may overshoot); the entropic policy's own rule waits only for rows
  about to finish, which ends each wait sooner (policies.py, "Which rows a burst is for").
  The decoding rows' guarantee above is unchanged: the batch runs in every round either way.
  Why 3: on the `online` workload at 80% load (simulated with a 2-core CPU's step costs,
  32 requests, 24 Poisson draws) the entropic rule alone, unbounded, gave mean latency
  0.72x FCFS's and p99 0.84x; bounded at 3 times the chunk round 0.75x and 0.81x, at 2
  times 0.76x and 0.84x. The former bound of R - 1 rounds in a row (with this rule) gave
  0.84x and 0.84x: a burst of a few rows is short next to a chunk round, and the rows
  about to finish need several.
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


def prefill_order(prefilling: Iterable[Sequence], policy: Policy, round_: int) -> list[Sequence]:
    """Admitted sequences still prefilling, in the order the policy gives them chunks."""
    return sorted(prefilling, key=lambda s: policy.prefill_key(s, round_))


WAIT_FACTOR = 3.0  # chunks wait while the bursts in their place took < 3x the chunk round


def prefill_waits(
    policy: Policy,
    batch: list[Sequence],
    chunks: list[tuple[Sequence, int]],
    steps: int,
    waited_seconds: float,
    chunk_seconds: float,
) -> bool:
    """Whether this round runs `batch` as a burst and `chunks` ((sequence, tokens) pairs)
    wait: the policy prefers it (`Policy.prefill_yields`) and the bound of the module
    docstring allows it. waited_seconds: the seconds on the engine's clock of the rounds in
    a row without chunks while some were ready; chunk_seconds: those of the last round that
    ran chunks (0 before one has run, so the first never waits)."""
    if not batch or not chunks or waited_seconds >= WAIT_FACTOR * chunk_seconds:
        return False
    return policy.prefill_yields(batch, chunks, steps)


def forced_count(
    last_runs: list[int], round_: int, batch_size: int, min_advance_rounds: int
) -> int:
    """How many of the earliest deadlines must run this round so that no resident sequence
    ever waits more than `min_advance_rounds` rounds (the module docstring's argument).

    last_runs: the round each resident sequence last ran or became resident."""
    deadlines = sorted(r + min_advance_rounds for r in last_runs)
    forced, due = 0, 0
    for d in range(min_advance_rounds):
        while due < len(deadlines) and deadlines[due] <= round_ + d:
            due += 1
        forced = max(forced, due - batch_size * d)
    return min(forced, batch_size)


def pick_batch(
    running: list[Sequence], policy: Policy, round_: int, batch_size: int, min_advance_rounds: int
) -> list[Sequence]:
    """The resident sequences that decode this round: the earliest deadlines the guarantee
    needs now (`forced_count`), then the policy's choice by priority."""
    by_deadline = sorted(running, key=lambda s: (s.last_run_round, s.order))
    forced = forced_count(
        [s.last_run_round for s in running], round_, batch_size, min_advance_rounds
    )
    chosen = by_deadline[:forced]
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
