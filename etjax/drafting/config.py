"""`SpeculationConfig`: the settings of entropic speculation."""

from __future__ import annotations

from dataclasses import dataclass

from etjax.errors import FieldError

# Largest verification width: a row's token and its drafts share one query tile of the
# attention plan (etjax/engine/device.py), sized 1 + max_draft rounded up to a power of two.
MAX_DRAFT_LIMIT = 15


@dataclass(frozen=True)
class SpeculationConfig:
    """How decoding sequences draft tokens for verification (etjax/drafting/rule.py has the
    rule and the reasons for its constants).

    enabled: draft and verify (under pruning, each drafted token reads the kept blocks a
      plain pruned step at its position would: etjax/runtime/steps.py `_per_token`).
    max_draft: the most tokens one sequence drafts per step; static (the verification pass
      checks this many positions), so a larger value costs every verifying step a little.
    ngram_max, ngram_min: the longest and shortest tail of the sequence matched against its
      earlier tokens (the longest found decides: etjax/drafting/ngram.py; 16 tells apart
      the places a list's or a passage's short tails recur, where 3 drafted the item just
      copied; docs/PERF.md, "Speculation at batch 1: what the counts hid"). A matched tail of
      min(8, ngram_max) tokens is a copy under way (rule.py, `COPY_TAIL`).
    entropy_max: no drafting after a token drawn from a distribution with more entropy than
      this (nats): the model is unsure, a copied continuation is unlikely to survive; except
      where the lookup matched a copy's tail (above), which drafts by its own acceptance
      estimate whatever the entropy.
    acceptance_prior: the expected fraction of drafts accepted before a sequence has history
      (0.72: what the defaults accepted on the mixed workload, batch 1, docs/PERF.md; at 0.5
      the cost gate would turn down a fresh sequence's first drafts, so it never learned);
      acceptance_memory: weight of the past in the running acceptance estimate.
    min_survival: draft k tokens only while the chance all k are accepted (estimated
      acceptance ** k) stays at least this.
    draft_budget: the most tokens a verifying step runs for its rows, their own tokens and
      drafts together; drafts go to the lowest-entropy sequences first. A decode step is
      bound by reading the weights only while it holds few tokens: past that, drafts that may
      be rejected cost real compute, so a full batch (32 rows, more than the budget) drafts
      nothing and runs as it would without speculation.
    pass_fixed_tokens, verify_row_tokens: the cost model that decides whether a round
      verifies at all (rule.py, `verification_pays`) until the engine has timed both a
      verifying step and a burst step of the batch's size on the machine it runs on
      (etjax/drafting/costs.py); from then on the measured ratio decides. In units of one
      token's compute: a model pass of n padded tokens costs pass_fixed_tokens + n (reading
      the weights, the call); a verifying step costs verify_row_tokens more per padded row
      (re-sampling its drafted positions: a sampler and an LM-head row each). The defaults
      fit the timings on the 2-core CPU of docs/PERF.md ("what a verifying step costs"). An
      accelerator reads its weights for far longer than it computes a few tokens, so
      pass_fixed_tokens is larger there (about twice its peak FLOP/s over its memory
      bandwidth in bytes, for float32 weights), and more rounds verify.
    measured_costs: let the step costs measured on this machine decide once there are
      some (above); false: the cost model's constants always decide (a test, or a
      `pass_fixed_tokens` of 1000 that verifies every round that can draft).
    forced_tokens: a constrained row drafts the tokens its grammar forces (a run of them
      costs one pass; etjax/drafting/forced.py), up to max_draft (and steps_per_sync - 1)
      per round. On by default and independent of `enabled`: forced drafts need no entropy
      rule, but they pass the cost gate (rule.py, `verification_pays`) with an acceptance
      of 1, since a verifying round is one ragged step where a burst would run
      `steps_per_sync`. Off: each forced token is a step of its own, as in a burst.
    """

    enabled: bool = False
    max_draft: int = 7
    ngram_max: int = 16
    ngram_min: int = 1
    entropy_max: float = 1.5
    acceptance_prior: float = 0.72
    acceptance_memory: float = 0.7
    min_survival: float = 0.25
    draft_budget: int = 16
    pass_fixed_tokens: float = 5.0
    verify_row_tokens: float = 0.5
    measured_costs: bool = True
    forced_tokens: bool = True

    def __post_init__(self) -> None:
        for name in ("enabled", "measured_costs", "forced_tokens"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise FieldError(name, value, "true or false")
        for name in ("max_draft", "ngram_max", "ngram_min", "draft_budget"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise FieldError(name, value, "a positive integer")
        if self.max_draft > MAX_DRAFT_LIMIT:
            raise FieldError("max_draft", self.max_draft, f"at most {MAX_DRAFT_LIMIT}")
        if self.ngram_min > self.ngram_max:
            raise FieldError(
                "ngram_min",
                self.ngram_min,
                f"<= ngram_max={self.ngram_max}: the shortest matched tail cannot exceed the "
                "longest",
            )
        for name in ("pass_fixed_tokens", "verify_row_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
                raise FieldError(name, value, "a number >= 0 (token computes)")
        if not self.entropy_max > 0:
            raise FieldError("entropy_max", self.entropy_max, "positive (nats)")
        for name in ("acceptance_prior", "min_survival"):
            value = getattr(self, name)
            if not 0 < value < 1:
                raise FieldError(name, value, "in (0, 1)")
        if not 0 <= self.acceptance_memory < 1:
            raise FieldError("acceptance_memory", self.acceptance_memory, "in [0, 1)")
