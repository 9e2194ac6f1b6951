"""Drafting for entropic speculation: what a decoding sequence proposes to verify.

- `config.py`: `SpeculationConfig`, the settings (off by default).
- `ngram.py`: prompt lookup: the continuation that followed an earlier occurrence of the
  sequence's longest recurring tail, in its prompt or its output.
- `rule.py`: how many tokens a sequence drafts this round, from its entropy (or, where the
  lookup matched a long tail, a copy under way) and how its recent drafts fared (a new
  sequence starting from the engine's pooled estimate), within a batch-wide budget.
- `costs.py`: `StepCosts`, a verifying step's and a burst step's seconds as the engine
  measured them on this machine (one table per process and model shape), which the rule's
  cost gate reads in place of its constants once it has them.
- `forced.py`: a constrained row's forced tokens (its grammar allows one token, or a run),
  drafted so that a run costs one pass where that pays; on without speculation. With
  speculation, a constrained row's lookup drafts are cut to what its grammar allows.

Verification is on the device (etjax/runtime/verify.py); the engine ties them together.
"""

from etjax.drafting.config import SpeculationConfig
from etjax.drafting.costs import StepCosts, compile_events, measured_costs
from etjax.drafting.forced import (
    forced_draft,
    forced_draft_limit,
    lookup_within_grammar,
    with_forced_drafts,
)
from etjax.drafting.ngram import TokenHistory, lookup_draft, matched_tail
from etjax.drafting.rule import DraftHistory, draft_lengths, record_verification

__all__ = [
    "DraftHistory",
    "SpeculationConfig",
    "StepCosts",
    "TokenHistory",
    "compile_events",
    "draft_lengths",
    "forced_draft",
    "forced_draft_limit",
    "lookup_draft",
    "lookup_within_grammar",
    "matched_tail",
    "measured_costs",
    "record_verification",
    "with_forced_drafts",
]
