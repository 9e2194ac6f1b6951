"""Scheduling policies: in which order waiting requests are admitted and admitted ones get
their prompt chunks, which resident sequences fill the device batch, and which one yields its
pages when the pool runs out.

A policy only ranks; the scheduler (scheduler.py) enforces the guarantees every policy shares:
minimum advancement, aging and page accounting.

- `fcfs`: arrival order everywhere, the baseline (as in vLLM).
- `priority`: the request's static priority (higher first), then arrival order.
- `entropic`: the paper's rule, expected entropy reduction per unit of cost.

The entropic estimator. Entropic time advances by dH+ = max(0, H_{t-1} - H_t) per token, so
the gain expected from running a sequence for one more token is predicted by the mean dH+ of
its own last `window` tokens; before it has two tokens, by `prior_drop` nats, an optimistic
value (above the typical dH+ of a resolved sequence), so a new sequence is tried early. The
cost of one token is the bytes it reads: its share of the weights (the batch shares one pass)
plus the KV bytes of the blocks its budget keeps (the last kept fraction times its length).
Priority = predicted dH+ per byte. Waiting requests have no history: they are ranked by the
prior over their cost, so short contexts (cheap tokens) go first, and by `aging` per round
waited so none waits forever. Admitted requests still prefilling are ranked the same way, by
what their first token still costs: the fewest context tokens left to prefill first (aged by
the rounds since admission), so a short question is not made to wait behind the prefill of
a long document admitted with it (FCFS prefills in admission order).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from etjax.engine.sequence import Sequence
from etjax.runtime.options import POLICIES


class Policy(Protocol):
    name: str

    def admission_key(self, seq: Sequence, round_: int) -> tuple:
        """Sort key of a waiting sequence: smaller is admitted first."""

    def prefill_key(self, seq: Sequence, round_: int) -> tuple:
        """Sort key of an admitted sequence still prefilling: smaller gets its chunk first."""

    def run_priority(self, seq: Sequence, round_: int) -> float:
        """Value of running a resident sequence now: larger runs first, smaller yields pages."""

    def observe(self, seq: Sequence, num_new_tokens: int) -> None:
        """Called after a burst with the tokens `seq` just produced."""


class FcfsPolicy:
    name = "fcfs"

    def admission_key(self, seq: Sequence, round_: int) -> tuple:
        return (seq.order,)

    def prefill_key(self, seq: Sequence, round_: int) -> tuple:
        return (seq.admitted_round, seq.order)

    def run_priority(self, seq: Sequence, round_: int) -> float:
        return -float(seq.order)

    def observe(self, seq: Sequence, num_new_tokens: int) -> None:
        pass


class PriorityPolicy(FcfsPolicy):
    name = "priority"

    def admission_key(self, seq: Sequence, round_: int) -> tuple:
        return (-seq.priority, seq.order)

    def prefill_key(self, seq: Sequence, round_: int) -> tuple:
        return (-seq.priority, seq.admitted_round, seq.order)

    def run_priority(self, seq: Sequence, round_: int) -> float:
        # Priority first; arrival order breaks ties (scaled far below one priority unit).
        return seq.priority - 1e-9 * seq.order


@dataclass
class EntropicPolicy:
    """Expected entropy reduction per byte read (see the module docstring)."""

    weight_bytes: float
    kv_bytes_per_key: float
    batch_size: int
    page_size: int
    window: int = 16
    prior_drop: float = 0.5
    aging: float = 0.05  # fraction of the prior's priority added per round waited
    name: str = "entropic"

    def token_bytes(self, seq: Sequence) -> float:
        kept = 1.0
        if seq.output.kept_blocks:
            blocks = -(-seq.length // self.page_size)
            kept = min(1.0, seq.output.kept_blocks[-1] / max(blocks, 1))
        return self.weight_bytes / self.batch_size + self.kv_bytes_per_key * kept * seq.length

    def expected_drop(self, seq: Sequence) -> float:
        drop = seq.recent_entropy_drop(self.window)
        return self.prior_drop if drop is None else drop

    def admission_key(self, seq: Sequence, round_: int) -> tuple:
        gain = self.prior_drop / self.token_bytes(seq)
        waited = max(round_ - seq.waiting_since, 0)
        return (-(gain * (1.0 + self.aging * waited)), seq.order)

    def prefill_key(self, seq: Sequence, round_: int) -> tuple:
        # Every prefilling sequence expects the prior's gain from its first token; what that
        # token still costs is the prefill left (the same weights' share and keys per token).
        left = len(seq.context) - seq.prefilled
        waited = max(round_ - seq.admitted_round, 0)
        return (left / (1.0 + self.aging * waited), seq.order)

    def run_priority(self, seq: Sequence, round_: int) -> float:
        return self.expected_drop(seq) / self.token_bytes(seq)

    def observe(self, seq: Sequence, num_new_tokens: int) -> None:
        pass  # the estimate reads the sequence's own trace


def make_policy(
    name: str, weight_bytes: float, kv_bytes_per_key: float, batch_size: int, page_size: int
):
    """The policy called `name` (one of POLICIES), with the model's cost constants."""
    if name == "fcfs":
        return FcfsPolicy()
    if name == "priority":
        return PriorityPolicy()
    if name == "entropic":
        return EntropicPolicy(weight_bytes, kv_bytes_per_key, batch_size, page_size)
    raise ValueError(f"policy={name!r}; must be one of {POLICIES}")
