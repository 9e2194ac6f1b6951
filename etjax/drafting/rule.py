"""How many tokens each decoding sequence drafts this round.

The signal is the one the whole engine runs on: the model entropy of the distribution the
sequence's last token was drawn from. After a confident token (entropy at most
`entropy_max`) the text is likely in a predictable stretch, a copied span or a formula, where
a looked-up continuation survives verification; after an uncertain one it rarely does, and a
drafted token that is rejected costs a token's compute for nothing. (AdaEDL, arXiv
2410.18351, stops drafting on an entropy-based bound of the acceptance probability; here there
is no draft model, so the target's own entropy plays that part.)

How far to draft follows how the sequence's drafts fared: with a running estimate a of the
fraction of its drafted tokens accepted, k drafted tokens all survive with probability about
a ** k, so the rule drafts the largest k with a ** k >= `min_survival` (at most `max_draft`).
A sequence whose drafts keep failing drifts to a = small and drafts one token, then none once
a ** 1 < min_survival; a successful one climbs back to the maximum. While a confident
sequence drafts nothing for want of acceptance, its estimate relaxes towards the prior each
round (`rest`), so it tries again after a few rounds rather than never.

Over the batch, drafting sequences are served lowest entropy first until the step holds
`draft_budget` tokens, the rows' own included (and within the step's token budget): a batch
of more rows than that drafts nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from etjax.drafting.config import SpeculationConfig


@dataclass
class DraftHistory:
    """What a sequence's drafts did so far: the running acceptance estimate and the totals
    its metrics report."""

    acceptance: float
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0  # steps in which it drafted

    def record(self, drafted: int, accepted: int, cfg: SpeculationConfig) -> None:
        """Fold one verification in: `accepted` of `drafted` tokens survived."""
        if drafted <= 0:
            return
        self.drafted += drafted
        self.accepted += accepted
        self.verify_steps += 1
        memory = cfg.acceptance_memory
        self.acceptance = memory * self.acceptance + (1 - memory) * accepted / drafted

    def rest(self, cfg: SpeculationConfig) -> None:
        """A round without drafting although the model was sure: relax towards the prior."""
        memory = cfg.acceptance_memory
        self.acceptance = memory * self.acceptance + (1 - memory) * cfg.acceptance_prior


def wanted_length(entropy: float | None, history: DraftHistory, cfg: SpeculationConfig) -> int:
    """Tokens one sequence would draft: 0 above `entropy_max` (or with no token yet), else the
    largest k <= max_draft with acceptance ** k >= min_survival (0 also rests the history)."""
    if entropy is None or entropy > cfg.entropy_max:
        return 0
    a = min(max(history.acceptance, 1e-6), 1 - 1e-6)
    k = min(cfg.max_draft, math.floor(math.log(cfg.min_survival) / math.log(a)))
    if k <= 0:
        history.rest(cfg)
    return max(k, 0)


def draft_lengths(
    entropies: list[float | None],
    histories: list[DraftHistory],
    cfg: SpeculationConfig,
    budget: int,
) -> list[int]:
    """Each sequence's draft length this step: `wanted_length`, granted lowest entropy first
    while the step stays within `draft_budget` tokens (one per row plus drafts) and `budget`
    drafted tokens."""
    wanted = [wanted_length(h, d, cfg) for h, d in zip(entropies, histories, strict=True)]
    left = min(cfg.draft_budget - len(wanted), budget)
    granted = [0] * len(wanted)
    for i in sorted(range(len(wanted)), key=lambda i: entropies[i] or 0.0):
        granted[i] = max(min(wanted[i], left), 0)
        left -= granted[i]
    return granted
