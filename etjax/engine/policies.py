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

A decode burst or a prompt chunk. A round that runs any prompt chunk is one ragged step, in
which every decoding row gets one token; a round without runs a burst of `steps_per_sync`
(K) decode steps. So while a 2K-6K-token document prefills in chunks of 512, FCFS holds
every decoding request to one token a round for as long as that takes: on the `online`
workload (SmolLM2, a 2-core CPU, docs/PERF.md "Where an `online` run's time goes") 40 of
a run's 79 rounds carried a chunk and took 73% of its device time, and the decoding rows got
133 tokens in them against 1,096 in the 39 bursts. The entropic policy values both uses of
the round by the paper's rule, expected entropy reduction per unit of cost, with a step of
n tokens costing F + n token computes (F: the pass's fixed cost, `pass_fixed_tokens`):

- a burst of the batch: sum of d_s * min(K, left_s) over its rows (d_s: `expected_drop`,
  left_s: tokens it may still generate), for K * (F + rows);
- the ragged step: sum of d_s (a token each) for F + rows + the chunks' tokens. A chunk
  resolves no uncertainty of its own: its prompt tokens have none until the sequence's first
  token, so the chunks count only when one of them ends its prompt. That round draws the
  first token, with an expected drop (the prior) a burst cannot give, and the new row decodes
  with the batch from then on; such a round is never deferred.

The chunks yield when the burst resolves more per cost, which is whenever the rows have K
tokens left and expect any drop: K * (F + rows) buys K times the ragged step's tokens for
less than K times its cost. Rows that are resolved (no drop expected) do not hold a prompt
back.

Which rows a burst is for. Per unit of cost the burst always looks better, so that rule
alone would hold a prompt back for as long as anyone decodes; what it leaves out is the
prompt's wait, and a burst shortens a row's latency only if the row finishes before the
prompt's prefill would have ended: such a row escapes crawling a token a round through the
rest of that prefill, at most L token computes (L: the tokens the waiting prompts have left
to prefill; the rows' own tokens in those rounds cost F + rows either way). A row that
outlives the prefill gains nothing: it crawls through it later instead. So the chunks wait
only for rows about to finish, shortest remaining work first (as SRPT orders jobs): with
the rows' tokens left x_1 <= x_2 <= ..., finishing the first j costs each of the m waiting
prompts x_j * (F + rows) of delay, and saves each of those j rows up to L, so the chunks
wait only if j * L > w * m * x_j * (F + rows) for some j, where w
(`prefill_delay_weight`) counts a prompt's delay w times: a prefill pushed back pushes back
the prompts queued behind it, and the prompt's own decode then runs beside the next
document's chunks, a token a round. Simulated (docs/PERF.md, "Prompt chunks only for rows
about to finish"; the engine's host logic on a 2-core CPU's step costs, the `online`
workload at 80% load, 32 requests, 24 Poisson draws; this rule alone, without the
scheduler's bound): w = 1 (the delay counted once) gave mean latency 0.75x FCFS's but p99
1.18x, the documents 1.54x; w from 6 to 11 all gave mean 0.70-0.77x and p99 0.78-0.86x,
the documents 0.89-0.95x (faster than under FCFS: their own decode crawls less); w = 12
waits too rarely (mean 0.83x). w = 8, the middle; with the scheduler's bound, 0.75x and
0.81x. Only rows with fewer than L / w tokens left can hold a prompt back, and no
sequence becomes resident in a round whose chunks wait (a prompt ends only in a round that
runs chunks), so every wait ends once those rows finish.
FCFS and `priority` never defer (as before); the scheduler also bounds how long prompts
wait in time (scheduler.py, `prefill_waits`).
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

    def prefill_yields(
        self, batch: list[Sequence], chunks: list[tuple[Sequence, int]], steps: int
    ) -> bool:
        """Whether the round should run `batch` as a burst of `steps` decode steps and give
        `chunks` ((sequence, tokens) pairs) a later round, rather than one ragged step
        (the module docstring; the scheduler bounds how long they wait)."""

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

    def prefill_yields(
        self, batch: list[Sequence], chunks: list[tuple[Sequence, int]], steps: int
    ) -> bool:
        return False  # prompts never wait for a burst: the baseline as it always ran

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
    pass_fixed_tokens: float = 5.0  # a pass's fixed cost in token computes (F above)
    prefill_delay_weight: float = 8.0  # w above: how much a waiting prompt's delay counts
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

    def prefill_yields(
        self, batch: list[Sequence], chunks: list[tuple[Sequence, int]], steps: int
    ) -> bool:
        if any(seq.prefilled + n >= len(seq.context) for seq, n in chunks):
            return False  # a first token is drawn this round
        fixed, rows = self.pass_fixed_tokens, len(batch)
        if not self.rows_finish_first(batch, chunks, fixed + rows):
            return False
        drops = [self.expected_drop(s) for s in batch]
        left = [s.settings.max_new_tokens - len(s.output.token_ids) for s in batch]
        burst = sum(d * min(steps, n) for d, n in zip(drops, left, strict=True))
        ragged = sum(drops)
        # burst / (steps * (fixed + rows)) > ragged / (fixed + rows + chunk tokens)
        tokens = sum(n for _, n in chunks)
        return burst * (fixed + rows + tokens) > ragged * steps * (fixed + rows)

    def rows_finish_first(
        self, batch: list[Sequence], chunks: list[tuple[Sequence, int]], step_cost: float
    ) -> bool:
        """Whether some j rows of `batch` (those with the fewest tokens left) finish soon
        enough to be worth the chunks' wait: j * L > w * m * x_j * step_cost, with L the
        tokens the m chunks' prompts have left to prefill, x_j the j-th fewest tokens left,
        step_cost a burst step's cost (the module docstring, "Which rows a burst is for")."""
        prompt_left = sum(len(seq.context) - seq.prefilled for seq, _ in chunks)
        delay = self.prefill_delay_weight * len(chunks) * step_cost
        left = sorted(s.settings.max_new_tokens - len(s.output.token_ids) for s in batch)
        return any((j + 1) * prompt_left > delay * x for j, x in enumerate(left))

    def observe(self, seq: Sequence, num_new_tokens: int) -> None:
        pass  # the estimate reads the sequence's own trace


def make_policy(
    name: str,
    weight_bytes: float,
    kv_bytes_per_key: float,
    batch_size: int,
    page_size: int,
    pass_fixed_tokens: float = 5.0,
):
    """The policy called `name` (one of POLICIES), with the model's cost constants
    (`pass_fixed_tokens`: a model pass's fixed cost in token computes, the speculation
    config's cost model)."""
    if name == "fcfs":
        return FcfsPolicy()
    if name == "priority":
        return PriorityPolicy()
    if name == "entropic":
        return EntropicPolicy(
            weight_bytes,
            kv_bytes_per_key,
            batch_size,
            page_size,
            pass_fixed_tokens=pass_fixed_tokens,
        )
    raise ValueError(f"policy={name!r}; must be one of {POLICIES}")
