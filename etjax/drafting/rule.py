"""How many tokens each decoding sequence drafts this round.

The signal is the one the whole engine runs on: the model entropy of the distribution the
sequence's last token was drawn from. After a confident token (entropy at most
`entropy_max`) the text is likely in a predictable stretch, a copied span or a formula, where
a looked-up continuation survives verification; after an uncertain one it rarely does, and a
drafted token that is rejected costs a token's compute for nothing. (AdaEDL, arXiv
2410.18351, stops drafting on an entropy-based bound of the acceptance probability; here there
is no draft model, so the target's own entropy plays that part.)

The lookup has evidence of its own: how long a tail of the text it matched (ngram.py,
`matched_tail`). Where the last `COPY_TAIL` tokens or more recur earlier, a copy is under way,
and its round is a copy round: it drafts whatever the last token's entropy, by an
acceptance estimate of its own. Copying a passage, the model's uncertain tokens are where it
chooses between the passage's wording and its own; once the choice is made the copy usually
goes on, and the tail says so. Over the plain greedy outputs of 26 batch-1 prompts
(docs/PERF.md, "Speculation at batch 1: the copy's evidence"), a lookup's drafted position
was accepted 0.97 of the time after a tail of 8 tokens or more, 0.87 after 2-7, 0.45 after
one, and the last token's entropy hardly mattered (after one above `entropy_max`: 0.95,
0.85, 0.48). Before, each of a passage's uncertain tokens (9 of 64 in one) was followed by
a plain burst of `steps_per_sync` steps. The copy estimate is kept apart from the row's
other one because a copy fails where the model leaves the text, a few drafts in a row, and
then returns to it: with one estimate those failures shut drafting for the rest of the copy.
For the same reason a new copy (a long tail after a round with a short one) starts again
from `COPY_ACCEPTANCE`. The shortest tail is evidence too, against: after a tail of one
token a drafted position was accepted 0.45 of the time, so such a round drafts by at most
that (`ONE_TOKEN_TAIL_ACCEPTANCE`), whatever the row's estimate learnt over longer ones.

How far to draft follows how the sequence's drafts fared: with a running estimate a of the
fraction of its drafted tokens accepted, k drafted tokens all survive with probability about
a ** k, so the rule drafts the largest k with a ** k >= `min_survival` (at most `max_draft`).
A sequence whose drafts keep failing drifts to a = small and drafts one token, then none once
a ** 1 < min_survival; a successful one climbs back to the maximum. While a confident
sequence drafts nothing for want of acceptance, its estimate relaxes towards the prior each
round (`rest`), so it tries again after a few rounds rather than never.

Where an estimate starts: a sequence's first estimate is the engine's pooled one (every
sequence's lookup drafts, summed per step, through the same running mean), not
`acceptance_prior`. A sequence drafts a few times in its life, too few to learn from its own
history alone: on the `long` workload rows started at the prior 0.72 and drafts were accepted
0-33% of the time, so each new row drafted and lost its first rounds (docs/PERF.md,
"Reading the verifying step at long context"). The pool starts at the prior. A row that
rests relaxes towards the pool, not the prior: there every row took its estimate before
any step verified, and after their own failures rows relaxing to the prior drafted again
every other round. The pool itself rests towards the prior, by a smaller step
(`POOL_REST_MEMORY`) once per round in which sure rows drafted nothing, so an engine whose
drafts failed still tries again now and then.

Over the batch, drafting sequences are served copy rounds first, then lowest entropy first,
until the step holds
`draft_budget` tokens, the rows' own included (and within the step's token budget): a batch
of more rows than that drafts nothing.

Drafting has a price beyond the drafted tokens: a round that verifies is one ragged step,
where a round without drafts runs `steps_per_sync` decode steps in one burst. So the batch
drafts only when a verifying step commits more tokens per unit of cost than a burst step
(`verification_pays`), each drafted token accepted with the probability its row's
acceptance estimate gives it. The price of a verifying step against a burst step is measured
on the machine the engine runs on (etjax/drafting/costs.py: the engine times its own steps);
until both are measured there, a cost model decides: a pass of n padded tokens costs
`pass_fixed_tokens` + n token computes, a verifying step `verify_row_tokens` more per padded
row. Before this gate, on the 2-core CPU of docs/PERF.md ("what a verifying step costs"), a
round drained to 15 rows verified one drafted token in a step that cost 1.7 burst steps,
and speculation cost the full loop a fifth of its throughput.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from etjax.buckets import batch_bucket
from etjax.drafting.config import SpeculationConfig
from etjax.drafting.costs import StepCosts, verify_token_bucket

# The pooled estimate's step towards the prior per round in which sure rows drafted nothing
# (a row's own step is `acceptance_memory`, 0.7). From a pool at 0.1 and a row at 0.2 (with
# min_survival 0.25 and the prior 0.72) the row drafts again in round 10; resting towards
# the prior it did in round 2 (tests/test_speculation.py, by hand), and on the `long`
# workload rows retried every other round while 0-33% of their drafts were accepted
# (docs/PERF.md).
POOL_REST_MEMORY = 0.95

# A copy under way: the lookup's matched tail (etjax/drafting/ngram.py, `matched_tail`) is
# at least this long (or ngram_max, if shorter). Over the plain greedy outputs of 26 batch-1
# prompts (benchmarks/speculation_gate.py's 12 and 14 held out: passages, edits, free-form),
# a lookup's drafted positions were accepted 0.97 of the time after a tail of 8 or more;
# after 2-7 tokens 0.87, but 0.59-0.76 in free-form answers, whose tails of 5-7 (a summary
# reusing a phrase of its document) made them draft and lose at a threshold of 4 or 6. A
# free-form answer's tail reached 8 only where it repeated itself (a poem's lines, the chat
# template after its end), and there its drafts were accepted too (docs/PERF.md,
# "Speculation at batch 1: the copy's evidence").
COPY_TAIL = 8
# Where a row's estimate for its copy rounds starts, and what it relaxes towards: below the
# 0.95-0.97 measured after a tail of 8 or more (above), as a row's failures pull it down.
COPY_ACCEPTANCE = 0.9
# A lookup that matched the last token alone (a tail of 1) has little evidence: over the same
# outputs its drafted positions were accepted 0.45 of the time, 0.48 after an uncertain token.
# A row's estimate, learnt over its longer tails, overstates that round: after a copy's end
# (the model leaves the passage, and the next tokens recur once at most) three such rounds
# of 3 drafts each were rejected whole, 1.8 burst steps each for one token. Such a round
# drafts by at most this estimate; with a 2-core CPU's step costs the gate then turns it
# down, where a verifying step costs about a burst step (an accelerator) one draft pays.
ONE_TOKEN_TAIL_ACCEPTANCE = 0.45

log = logging.getLogger("etjax")


@dataclass
class DraftHistory:
    """What a sequence's drafts did so far: the running acceptance estimate and the totals
    its metrics report."""

    acceptance: float
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0  # steps in which it drafted
    # The estimate for copy rounds (the lookup matched a tail of `COPY_TAIL` tokens), and
    # whether this round is one (`draft_lengths` sets it): the verdict and any rest move
    # that estimate, not `acceptance`.
    copying: float = COPY_ACCEPTANCE
    copy: bool = False
    # This round's cap on `acceptance` from the lookup's evidence (`draft_lengths` sets it:
    # ONE_TOKEN_TAIL_ACCEPTANCE after a tail of one token).
    ceiling: float = 1.0

    @property
    def estimate(self) -> float:
        """The acceptance estimate this round drafts by: `copying` in a copy round, else
        `acceptance` within this round's `ceiling`."""
        return self.copying if self.copy else min(self.acceptance, self.ceiling)

    def record(
        self,
        drafted: int,
        accepted: int,
        cfg: SpeculationConfig,
        learn: bool = True,
        checked: int | None = None,
    ) -> None:
        """Fold one verification in: `accepted` of `drafted` tokens survived. `learn`: it
        moves the acceptance estimate too (a lookup's verdict; a grammar's forced run is
        certain and says nothing of how lookups fare, so it only counts in the totals).

        The estimate is of a drafted position's chance to be accepted once the ones before
        it were (what `expected_accepted` reads): accepted over the positions checked, up
        to the first rejection (`checked`, default min(drafted, accepted + 1)); the drafts
        after it were never tried. Over all drafted, a row whose 7 drafts failed at the
        fifth would read 4 / 7 = 0.57 where its positions held 4 / 5 = 0.8, and drafts
        filling a step's padding (`best_lengths`) would drag it lower still."""
        if drafted <= 0:
            return
        self.drafted += drafted
        self.accepted += accepted
        self.verify_steps += 1
        if not learn:
            return
        checked = min(drafted, accepted + 1) if checked is None else checked
        memory = cfg.acceptance_memory
        # The verdict moves the estimate itself, not this round's cap of it.
        before = self.copying if self.copy else self.acceptance
        estimate = memory * before + (1 - memory) * accepted / checked
        if self.copy:
            self.copying = estimate
        else:
            self.acceptance = estimate

    def rest(
        self, cfg: SpeculationConfig, toward: float | None = None, memory: float | None = None
    ) -> None:
        """A round without drafting although the model was sure: relax towards `toward`
        (a row: the engine's pooled estimate), or the prior, keeping `memory` of the
        estimate (default `acceptance_memory`; the pool keeps POOL_REST_MEMORY). In a copy
        round the copy estimate relaxes, towards `COPY_ACCEPTANCE`."""
        memory = cfg.acceptance_memory if memory is None else memory
        if self.copy:
            self.copying = memory * self.copying + (1 - memory) * COPY_ACCEPTANCE
            return
        target = cfg.acceptance_prior if toward is None else toward
        self.acceptance = memory * self.acceptance + (1 - memory) * target


def record_verification(
    histories: list[DraftHistory],
    drafted: list[int],
    accepted: list[int],
    lookup: list[bool],
    pool: DraftHistory,
    cfg: SpeculationConfig,
) -> None:
    """Fold one verifying step in: row i drafted `drafted[i]` tokens and `accepted[i]`
    survived. Each row's own history takes its verdict; `pool`, the engine's, takes the
    step's lookup drafts (`lookup[i]`) summed, as one verification. A constrained row's
    forced drafts are always accepted and say nothing of how lookups fare: they count in the
    row's totals but move no estimate (the row may draft by lookup where its next token is
    free). Nor do a copy round's drafts move the pool: it is where new rows start and
    resting rows return for their other rounds, which copies would flatter."""
    for history, n, took, is_lookup in zip(histories, drafted, accepted, lookup, strict=True):
        history.record(n, took, cfg, learn=is_lookup)
    lookup = [is_lookup and not h.copy for h, is_lookup in zip(histories, lookup, strict=True)]
    rows = zip(drafted, accepted, lookup, strict=True)
    pooled = [(n, took) for n, took, is_lookup in rows if is_lookup]
    checked = sum(min(n, took + 1) for n, took in pooled)
    pool.record(sum(n for n, _ in pooled), sum(took for _, took in pooled), cfg, checked=checked)


def wanted_length(
    entropy: float | None,
    history: DraftHistory,
    cfg: SpeculationConfig,
    pool: DraftHistory | None = None,
) -> int:
    """Tokens one sequence would draft: 0 above `entropy_max` (or with no token yet) unless
    this is a copy round (`history.copy`), else the largest k <= max_draft with
    estimate ** k >= min_survival (0 also rests the history, towards `pool`'s estimate if
    given)."""
    if not history.copy and (entropy is None or entropy > cfg.entropy_max):
        return 0
    a = min(max(history.estimate, 1e-6), 1 - 1e-6)
    k = min(cfg.max_draft, math.floor(math.log(cfg.min_survival) / math.log(a)))
    if k <= 0:
        history.rest(cfg, None if pool is None else pool.acceptance)
    return max(k, 0)


def draft_lengths(
    entropies: list[float | None],
    histories: list[DraftHistory],
    cfg: SpeculationConfig,
    budget: int,
    pool: DraftHistory | None = None,
    costs: StepCosts | None = None,
    tails: list[int] | None = None,
) -> list[int]:
    """Each sequence's draft length this step: `wanted_length`, granted lowest entropy first
    (copy rounds before them) while the step stays within `draft_budget` tokens (one per row
    plus drafts) and `budget` drafted tokens, if verifying them pays (`verification_pays`,
    with the step costs measured on this machine in `costs`). `pool`: the engine's pooled
    estimate, which resting rows relax towards and which itself rests once in a round where
    a sure row drafted nothing. `tails`: each row's matched tail (ngram.py,
    `matched_tail`); a row's round is a copy round where it is at least `COPY_TAIL` (or
    ngram_max) long (None: no row's is)."""
    copy_tail = min(COPY_TAIL, cfg.ngram_max)
    looked_up = tails is not None
    tails = [0] * len(histories) if tails is None else tails
    for history, tail in zip(histories, tails, strict=True):
        if tail >= copy_tail and not history.copy:
            # A new copy (the last round's tail was shorter): the failures where the model
            # left the last one say where it left, not whether it leaves this one early.
            history.copying = max(history.copying, COPY_ACCEPTANCE)
        history.copy = tail >= copy_tail
        history.ceiling = ONE_TOKEN_TAIL_ACCEPTANCE if looked_up and tail == 1 else 1.0
    wanted = [wanted_length(h, d, cfg, pool) for h, d in zip(entropies, histories, strict=True)]
    sure = [
        d.copy or (h is not None and h <= cfg.entropy_max)
        for h, d in zip(entropies, histories, strict=True)
    ]
    # A sure row that wants nothing has rested (`wanted_length`).
    rested = any(s and not w for s, w in zip(sure, wanted, strict=True))
    left = min(cfg.draft_budget - len(wanted), budget)
    order = sorted(range(len(wanted)), key=lambda i: (not histories[i].copy, entropies[i] or 0.0))
    granted = [0] * len(wanted)
    room = left
    for i in order:
        granted[i] = max(min(wanted[i], room), 0)
        room -= granted[i]
    acceptance = [d.estimate for d in histories]
    lengths = best_lengths(granted, order, acceptance, cfg, left, costs)
    if lengths is None:
        # Turned down by the cost: confident rows rest, as when their own estimate stops
        # them, so a batch that drains to where verifying pays tries again.
        for i, want in enumerate(wanted):
            if want:
                histories[i].rest(cfg, None if pool is None else pool.acceptance)
        rested = rested or any(wanted)
    if pool is not None and rested:  # once a round, however many rows rested
        pool.rest(cfg, memory=POOL_REST_MEMORY)
    return lengths if lengths is not None else [0] * len(granted)


def best_lengths(
    granted: list[int],
    order: list[int],
    acceptance: list[float],
    cfg: SpeculationConfig,
    left: int,
    costs: StepCosts | None = None,
) -> list[int] | None:
    """The draft lengths that commit the most tokens per unit of cost, or None where a burst
    step commits more (`verification_rate`).

    A verifying step pads its tokens to a bucket (`verify_token_bucket`: 2, 4, 8, ...) and
    costs by it, so the candidates are the rows' `granted` lengths cut to each cap of
    2 ** j - 1 drafts (and max_draft), each then filled up to its step's slots: drafts in
    padding that the step computes anyway cost only their checks, so a granted row (`order`:
    the rows, first served first) drafts into them, within `left` drafted tokens. At batch 1
    on a 2-core CPU with 4-bit weights, where 2, 4 and 8 slots cost about 1.4, 1.8 and 2.7
    burst steps, a row accepting 0.72 of its drafts does best with 3 (2.61 tokens for 1.8
    steps), one accepting 0.95 with 7."""
    best, best_rate, tried = None, float(len(granted)), []  # a burst step: a token a row
    for cap in draft_caps(cfg.max_draft) if any(granted) else []:
        lengths = _filled([min(g, cap) for g in granted], order, cfg.max_draft, left)
        if lengths in tried:  # a cap above every granted length: the same step
            continue
        tried.append(lengths)
        rate = verification_rate(lengths, acceptance, cfg, costs)
        if rate > best_rate:
            best, best_rate = lengths, rate
    return best


def draft_caps(max_draft: int) -> list[int]:
    """Drafts per row that fill a lone row's step bucket (1, 3, 7, ...), then max_draft: the
    lengths a verifying step at batch 1 is worth considering at."""
    caps, cap = [], 1
    while cap < max_draft:
        caps.append(cap)
        cap = 2 * cap + 1
    return [*caps, max_draft]


def _filled(lengths: list[int], order: list[int], max_draft: int, left: int) -> list[int]:
    # `lengths` with the step's padding given to its drafting rows, in `order`, each up to
    # the step's slots per row, within `left` drafted tokens in all.
    rows, lengths = len(lengths), list(lengths)
    tokens = verify_token_bucket(rows + sum(lengths))
    slots = min(max_draft, tokens - 1)
    free = min(tokens - rows - sum(lengths), left - sum(lengths))
    for i in order:
        if lengths[i] and free > 0:
            extra = min(slots - lengths[i], free)
            lengths[i] += max(extra, 0)
            free -= max(extra, 0)
    return lengths


def expected_accepted(length: int, acceptance: float) -> float:
    """Drafted tokens a row accepts in expectation: draft i survives when all i before it
    and itself do, about acceptance ** i."""
    return sum(acceptance**i for i in range(1, length + 1))


def verification_pays(
    lengths: list[int],
    acceptance: list[float],
    cfg: SpeculationConfig,
    costs: StepCosts | None = None,
) -> bool:
    """Whether one verifying step over a batch whose rows draft `lengths` tokens (running
    acceptance estimates `acceptance`) commits more tokens per unit of cost than a step of a
    decode burst over the same rows.

    A burst step runs the rows and commits a token each; a verifying step runs them and their
    drafts and commits each row's token and its accepted drafts. So it pays when its cost
    over a burst step's (`step_cost_ratio`: measured on this machine where `costs` has it,
    else the cost model) is below (rows + expected accepted drafts) / rows. The decision and
    its inputs are logged at debug level (logger "etjax")."""
    return verification_rate(lengths, acceptance, cfg, costs) > len(lengths)


def verification_rate(
    lengths: list[int],
    acceptance: list[float],
    cfg: SpeculationConfig,
    costs: StepCosts | None = None,
) -> float:
    """Tokens a verifying step over rows drafting `lengths` tokens commits in expectation per
    burst step of cost: (rows + expected accepted drafts) / (its cost over a burst step's);
    a burst step commits `rows` (0 where nothing is drafted). The figures and the verdict
    against a burst are logged at debug level (logger "etjax")."""
    drafted, rows = sum(lengths), len(lengths)
    if not drafted:
        return 0.0
    gained = sum(expected_accepted(k, a) for k, a in zip(lengths, acceptance, strict=True))
    checked = max(expected_positions(k, a) for k, a in zip(lengths, acceptance, strict=True))
    ratio, source = step_cost_ratio(rows, drafted, cfg, costs, checked)
    rate = (rows + gained) / ratio
    if log.isEnabledFor(logging.DEBUG):
        log.debug(
            "speculation gate: %d rows draft %s, %.2f expected accepted; a verifying step "
            "costs %.2fx a burst step (%s), pays below %.2fx: %s",
            rows,
            lengths,
            gained,
            ratio,
            source,
            (rows + gained) / rows,
            "verify" if rate > rows else "burst",
        )
    return rate


def expected_positions(length: int, acceptance: float) -> float:
    """Drafted positions a row's verification checks in expectation: position i (from 0)
    while its i drafts before are all accepted, about acceptance ** i."""
    return sum(acceptance**i for i in range(length))


def step_cost_ratio(
    rows: int,
    drafted: int,
    cfg: SpeculationConfig,
    costs: StepCosts | None = None,
    checked: float = 0.0,
) -> tuple[float, str]:
    """A verifying step of `rows` rows and `drafted` drafts (checking about `checked`
    drafted positions: the most any row is expected to reach, `expected_positions`) against
    a burst step over the same rows, and where the figure comes from: the seconds measured
    on this machine
    (`costs`, etjax/drafting/costs.py) once it holds both shapes and `cfg.measured_costs` is
    on, else the cost model (`verify_step_cost` over `burst_step_cost`)."""
    if costs is not None and cfg.measured_costs:
        burst = costs.burst_seconds(rows)
        verify = costs.verify_seconds(
            rows, drafted, lambda r, tokens: verify_step_cost(r, tokens - r, cfg), checked
        )
        if burst is not None and verify is not None:
            return verify / burst, f"measured: {verify * 1e3:.1f} ms against {burst * 1e3:.1f} ms"
    model = verify_step_cost(rows, drafted, cfg) / burst_step_cost(rows, cfg)
    return model, (
        f"cost model: pass_fixed_tokens={cfg.pass_fixed_tokens}, "
        f"verify_row_tokens={cfg.verify_row_tokens}"
    )


def burst_step_cost(rows: int, cfg: SpeculationConfig) -> float:
    """One decode step of a burst over `rows` rows (padded to their bucket), in token
    computes."""
    return cfg.pass_fixed_tokens + batch_bucket(rows)


def verify_step_cost(rows: int, drafted: int, cfg: SpeculationConfig) -> float:
    """A ragged step of `rows` rows verifying `drafted` tokens, in token computes: the pass
    over the step's padded tokens and the re-sampling over its padded rows."""
    padded = verify_token_bucket(rows + drafted)
    return cfg.pass_fixed_tokens + padded + cfg.verify_row_tokens * batch_bucket(rows)
