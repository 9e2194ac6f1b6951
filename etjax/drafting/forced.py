"""Forced tokens as drafts: where a request's grammar allows one token (or a run of them),
the row drafts the run, so it costs one model pass instead of one per token.

Under a constraint many tokens are forced: a JSON schema's braces, quotes and keys. The row's
next token is drawn on the device as always (the first of the run, since its mask allows only
that one), and the rest of the run rides behind it as drafts, verified under the grammar's
masks by the speculation path (etjax/runtime/verify.py). Verification is what makes it exact:
each drafted position is drawn as the plain step would draw it, so the output is the one the
same request gives without the shortcut (greedy exactly; sampling up to float rounding). The
tokens come from the row's matcher (llguidance's fast-forward tokens, etjax/constraints/matcher.py),
which has consumed every committed token by the time the host plans the next round.

Forced drafts need no speculation: they are drafted whenever `SpeculationConfig.forced_tokens`
is on (the default), with `enabled` off too; `max_draft` bounds a run per round (within the
pages a round reserves). They pass speculation's cost gate (rule.py, `verification_pays`) with
an acceptance of 1, since every one is accepted unless the row ends first: a round that
verifies is one ragged step where one without drafts is a burst of `steps_per_sync` steps,
and where a pass costs about its tokens' compute (a CPU at batch 32: docs/PERF.md,
"Structured output") a few forced drafts in a full batch do not pay for that; where reading
the weights dominates a pass (an accelerator, a drained batch) they do.

With speculation on, a constrained row whose next token is free drafts by prompt lookup like
any row (an extraction's values are often copied from its document), cut where its grammar
would refuse the draft (`lookup_within_grammar`), and verified under the masks the same way;
where the grammar forces a run, the run replaces the lookup.
"""

from __future__ import annotations

from etjax.constraints.matcher import forced_tokens, valid_prefix
from etjax.drafting.config import SpeculationConfig
from etjax.drafting.costs import StepCosts, verify_token_bucket
from etjax.drafting.rule import verification_pays


def forced_draft_limit(spec: SpeculationConfig, steps_per_sync: int) -> int:
    """The most forced tokens a row drafts per round: `max_draft`, within the
    `steps_per_sync` tokens a round reserves pages for (its own token among them); 0 when
    neither speculation nor forced tokens are on."""
    if spec.enabled:
        return spec.max_draft  # the options already hold it within steps_per_sync
    if not spec.forced_tokens:
        return 0
    return max(min(spec.max_draft, steps_per_sync - 1), 0)


def forced_draft(grammar: int, limit: int, tokens_left: int) -> list[int]:
    """What a constrained row (matcher id `grammar`) drafts this round: the forced tokens after
    the first, which the device draws itself, at most `limit` of them and no more than the
    row may still generate after that first one (`tokens_left` counts it too)."""
    if limit <= 0 or tokens_left <= 1:
        return []
    run = forced_tokens(grammar)
    return run[1 : 1 + min(limit, tokens_left - 1)]


def lookup_within_grammar(grammar: int, lookup: list[int]) -> list[int]:
    """A constrained row's lookup drafts: `lookup` is the prompt-lookup continuation, its
    first token the prediction of what the device draws this step and the rest the drafts.
    Returns the drafts cut where the grammar would refuse them (after that prediction): the
    mask would reject them in verification anyway, at the price of their compute. None when
    the prediction itself is refused (the device cannot draw it, so what follows it is not
    what the row will write)."""
    valid = valid_prefix(grammar, lookup)
    return lookup[1:valid] if valid > 0 else []


def with_forced_drafts(
    drafts: list[list[int]],
    grammars: list[int],
    tokens_left: list[int],
    acceptance: list[float],
    spec: SpeculationConfig,
    steps_per_sync: int,
    budget: int,
    costs: StepCosts | None = None,
) -> tuple[list[list[int]], list[bool]]:
    """A batch's drafts with each constrained row's forced run in place of its lookup draft,
    if verifying them pays.

    drafts: speculation's drafts per row (a constrained row's cut to its grammar, or none
    with speculation off); grammars: each row's matcher id (-1 unconstrained); tokens_left:
    what each row may still generate; acceptance: each row's running acceptance estimate
    (its lookup drafts'); budget: the drafted tokens the step's token budget leaves; costs:
    the step costs measured on this machine, for the cost gate (None: the cost model). Returns
    the drafts and which rows' are forced runs (certain to be accepted unless the row ends);
    `drafts` itself and no forced row when no row has a forced run or the cost gate turns
    them down."""
    out, forced = list(drafts), [False] * len(drafts)
    if not spec.forced_tokens:  # each forced token a step of its own, speculation on or off
        return drafts, forced
    limit = forced_draft_limit(spec, steps_per_sync)
    budget -= sum(len(d) for d in drafts)
    for j, grammar in enumerate(grammars):
        if grammar < 0:
            continue
        run = forced_draft(grammar, min(limit, budget + len(out[j])), tokens_left[j])
        if run:  # the grammar forces what follows: no lookup can do better
            budget += len(out[j]) - len(run)
            out[j], forced[j] = run, True
    if not any(forced):
        return drafts, forced
    certain = [1.0 if f else a for f, a in zip(forced, acceptance, strict=True)]
    if verification_pays([len(d) for d in out], certain, spec, costs):
        return out, forced
    # Turned down: the runs cut to the padding the step's token bucket has anyway (a
    # drained batch of 20 rows runs 32 tokens), which may pay where the whole runs did not.
    room = verify_token_bucket(len(drafts) + sum(len(d) for d in drafts)) - len(drafts)
    room -= sum(len(d) for j, d in enumerate(drafts) if not forced[j])
    for j in range(len(out)):
        if forced[j]:
            out[j] = out[j][: max(room, 0)]
            room -= len(out[j])
            forced[j] = bool(out[j])
    if any(forced) and verification_pays([len(d) for d in out], certain, spec, costs):
        return out, forced
    return drafts, [False] * len(drafts)
