"""`accept_drafts`: verification of drafted tokens, lossless for every sampler.

A speculating row runs, in one pass, the token it sampled and the tokens drafted after it
(etjax/drafting/); the pass gives the distribution after each of them. Draft i is
then checked by sampling position i exactly as the non-speculative step would: from the
distribution after the accepted prefix, with the row's sampler (penalties, temperature or the
entropic controller, truncation, Mirostat) in the state the committed prefix left it, keyed
by the token's index in the output. The draft is accepted if that sample equals it; the first
mismatch ends the row's acceptance, and the mismatched sample is not committed: the row keeps
the distribution it came from, and its next step draws the same sample again (same logits,
same sampler state, same key), so nothing is lost.

For a deterministic draft this is the speculative-sampling rule for a point-mass proposal
(accept with probability p(draft), otherwise a token drawn from p without the draft), with
the randomness coupled to the non-speculative run: a request's output is the one it would
have produced without speculation, token for token, up to the float rounding of running
several tokens in one pass. Each committed token is accounted as its own step (commit.py);
rejected drafts are charged the compute they cost.

Constrained rows (a program with `constrained`) draft their grammar's forced tokens
(etjax/drafting/forced.py), and each position is checked as their plain step draws: under the
row's mask, then, for an accepted draft, the mask after it from the row's matcher (the same
ordered callbacks, etjax/runtime/token_mask.py; the host's work overlaps the LM head). A
forced draft is thus accepted because the masked draw makes it, not because the host said so.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from etjax.entropy.cost import CostModel
from etjax.model.transformer import logits_from_hidden
from etjax.model.weights import Weights
from etjax.request_fields import MAX_LOGPROBS
from etjax.runtime.commit import commit_tokens, draw_rows
from etjax.runtime.state import DecodeState, StepOutputs
from etjax.runtime.token_mask import collect_masks, start_masks

# The most drafted positions (padded rows x max_draft) whose logits are computed in one
# product before the checks. Per position, each check's LM-head product reads the whole head
# (49,152 x 576 float32 for SmolLM2: 113 MB) for a few rows, so at batch 1 a verifying step
# whose 7 drafts were all accepted read it 8 times and cost about 3 burst steps on a 2-core
# CPU (benchmarks/speculation_gate.py); in one product it is read once, at the price of the
# positions no row reaches. Past this many positions that compute outgrows the reads saved.
PRECOMPUTED_POSITIONS = 16


def precomputes_logits(num_rows: int, max_draft: int, constrained: int) -> bool:
    """Whether a verifying step over `num_rows` padded rows of `max_draft` drafts each
    computes every drafted position's distribution in one product before the checks
    (`PRECOMPUTED_POSITIONS`): unconstrained (a constrained check's masks overlap its own
    position's product) and few positions."""
    return not constrained and num_rows * max_draft <= PRECOMPUTED_POSITIONS


def row_and_draft_logits(
    weights: Weights, hidden: jax.Array, draft_hidden: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The distributions after each row's token and after each of its drafts, float32
    [B, V] and [B, k, V], from one LM-head product (hidden [B, D], draft_hidden [B, k, D]).

    A verifying step where `precomputes_logits` holds takes its rows' next logits from here
    and hands the drafts' to `accept_drafts`: the head (113 MB for SmolLM2 in float32) is
    read once for all 1 + k positions, where a product for the rows' tokens and another for
    their drafts read it twice (at batch 1 on a 2-core Zen 4, 8 and 13 ms of CPU time for
    the one row and the 7 drafts apart, 14 ms together)."""
    rows = jnp.concatenate([hidden[:, None], draft_hidden.astype(hidden.dtype)], axis=1)
    logits = logits_from_hidden(weights, rows)
    return logits[:, 0], logits[:, 1:]


def accept_drafts(
    weights: Weights,
    state: DecodeState,
    drafts: jax.Array,
    draft_len: jax.Array,
    draft_hidden: jax.Array,
    cost: CostModel,
    constrained: int = 0,
    reads: Callable[[jax.Array], tuple[jax.Array, jax.Array]] | None = None,
    draft_logits: jax.Array | None = None,
) -> tuple[DecodeState, StepOutputs]:
    """Accept the longest prefix of each row's drafts its sampler reproduces.

    state: the rows after committing the token they sampled this step (its logits are the
    distribution after that token); drafts: [B, k] int32 the tokens run after it; draft_len:
    [B] int32 how many of them are real (the row ran them only if it is still active);
    draft_hidden: [B, k, D] the final hidden state after each draft. Returns the state after
    the accepted drafts and their outputs [k, B] (emitted where accepted). `constrained`
    (static, `StepStatics.constrained`): at most this many rows' grammars mask each position
    as in the plain step (`_decode_step`).
    `reads(num_blocks [B]) -> (kept fraction, kept blocks)`: what a draft read under pruning,
    for the trace and the cost (None: every block of its context). `draft_logits`: [B, k, V]
    the distribution after each draft where the caller computed it (`row_and_draft_logits`).

    Draft i is checked only while some row is still accepting (a `lax.cond`): the i-th
    distribution (an LM-head product over the batch) and sample cost nothing once every row
    has stopped. With few positions in all (`precomputes_logits`), every position's
    distribution comes from one product before the checks instead (`draft_logits`, or here).
    """
    ran = state.active & (draft_len > 0)  # rows whose drafts went through the model
    all_logits = draft_logits
    if all_logits is None and precomputes_logits(*drafts.shape, constrained):
        # [B, k, V]: the distribution after each draft, the LM head read once.
        all_logits = logits_from_hidden(weights, draft_hidden)
    check = functools.partial(
        _check,
        _Pass(weights, drafts, draft_len, draft_hidden, cost, constrained, reads, all_logits),
    )

    def position(carry, i):
        pending = jnp.any(carry[1] & (i < draft_len))
        return jax.lax.cond(pending, check, _skip, carry, i)

    # A scan, not an unrolled loop: the sampler is the largest part of the program, and each
    # unrolled position compiled a copy of it (a tiny model's step with 4 drafts took ~3 s to
    # compile, most of it these copies).
    carry = (state, state.active, jnp.zeros_like(draft_len))
    carry, outputs = jax.lax.scan(position, carry, jnp.arange(drafts.shape[1]))
    state, _, accepted = carry
    return _charge_rejected(state, ran, draft_len, accepted, cost), outputs


class _Pass(NamedTuple):
    # What every position's check reads (shapes as in `accept_drafts`).
    weights: Weights
    drafts: jax.Array  # [B, k] int32
    draft_len: jax.Array  # [B] int32
    draft_hidden: jax.Array  # [B, k, D]
    cost: CostModel
    constrained: int  # static
    reads: Callable[[jax.Array], tuple[jax.Array, jax.Array]] | None
    all_logits: jax.Array | None  # [B, k, V] float32, or None: each position's own product


def _check(p: _Pass, carry, i):
    # Position i: each still accepting row draws its token and takes the draft if they are
    # equal. carry: (state, accepting [B] bool, accepted [B] int32); returns the carry and
    # the position's outputs [B].
    state, accepting, accepted = carry
    raw = state.logits
    state, tokens, info, sampler_state = draw_rows(state, p.constrained)
    draft = jax.lax.dynamic_index_in_dim(p.drafts, i, axis=1, keepdims=False)
    take = accepting & (i < p.draft_len) & (tokens == draft)
    fraction, kept, flops, nbytes = _draft_cost(state, info, take, p.cost, p.reads)
    next_logits, allowed = _next_logits(p, state, tokens, take, i)
    state, out = commit_tokens(
        state, tokens, info, sampler_state, take, next_logits, fraction, kept, flops, nbytes
    )
    if p.constrained:
        # A row that took nothing keeps its raw logits (the next step masks them again and
        # reads their entropy); one that took a draft has what the plain step leaves.
        state = state.replace(
            logits=jnp.where(take[:, None], state.logits, raw),
            allowed=jnp.where(take[:, None], allowed, state.allowed),
        )
    return (state, take & state.active, accepted + take), out


def _draft_cost(state: DecodeState, info, take: jax.Array, cost: CostModel, reads):
    # A taken draft's kept fraction [B] and blocks [B], and its FLOPs and bytes [B] float32
    # (0 where not taken; the weights were read once, by the pass).
    num_blocks = (state.lengths + cost.page_size) // cost.page_size
    fraction, kept = (
        (jnp.ones_like(info.model_entropy), num_blocks) if reads is None else reads(num_blocks)
    )
    keys = cost.layer_keys((kept * cost.page_size).astype(jnp.float32))
    flops = cost.matmul_flops_per_token + cost.attention_flops_per_key * keys
    flops = jnp.where(take, flops, 0.0)
    nbytes = jnp.where(take, cost.kv_bytes_per_key * keys, 0.0)
    return fraction, kept, flops, nbytes


def _next_logits(p: _Pass, state: DecodeState, tokens: jax.Array, take: jax.Array, i):
    # The distribution after draft i [B, V], and under constraints the rows' masks after
    # their accepted drafts [B, W] (the others keep theirs; None unconstrained), computed on
    # the host while the LM head runs.
    hidden = jax.lax.dynamic_index_in_dim(p.draft_hidden, i, axis=1, keepdims=False)
    if p.constrained:
        hidden, ticket = start_masks(
            state.grammar,
            tokens,
            state.num_generated,
            take,
            state.allowed.shape[1],
            only_committed=True,
            overlap=hidden,
        )
    if p.all_logits is not None:
        next_logits = jax.lax.dynamic_index_in_dim(p.all_logits, i, axis=1, keepdims=False)
    else:
        next_logits = logits_from_hidden(p.weights, hidden)
    allowed = None
    if p.constrained:
        allowed = collect_masks(ticket, next_logits, *state.allowed.shape)
    return next_logits, allowed


def _skip(carry, i):
    # A position no row still accepts: nothing checked, nothing emitted.
    del i
    state, accepting, accepted = carry
    return (state, jnp.zeros_like(accepting), accepted), _nothing(state)


def _charge_rejected(state, ran, draft_len, accepted, cost: CostModel) -> DecodeState:
    # Rejected drafts still ran: their compute is the request's. ran [B] bool: rows whose
    # drafts went through the model; draft_len, accepted [B] int32.
    rejected = jnp.where(ran, draft_len - accepted, 0).astype(jnp.float32)
    keys = cost.layer_keys((state.lengths + rejected).astype(jnp.float32))
    entropy = state.entropy
    return state.replace(
        entropy=entropy.replace(
            cost_flops=entropy.cost_flops
            + rejected * (cost.matmul_flops_per_token + cost.attention_flops_per_key * keys),
            cost_bytes=entropy.cost_bytes + rejected * cost.kv_bytes_per_key * keys,
        )
    )


def _nothing(state: DecodeState) -> StepOutputs:
    # The outputs of a check no row needed: nothing emitted.
    zeros = jnp.zeros_like(state.entropy.tau)
    top_shape = (state.logits.shape[0], min(MAX_LOGPROBS, state.logits.shape[1]))
    return StepOutputs(
        tokens=jnp.zeros_like(state.lengths),
        model_entropy=zeros,
        raw_entropy=zeros,
        calibrated_entropy=zeros,
        logprob=zeros,
        sampled_entropy=zeros,
        temperature=zeros,
        tau=state.entropy.tau,
        cost_flops=state.entropy.cost_flops,
        cost_bytes=state.entropy.cost_bytes,
        kept_blocks=jnp.zeros_like(state.lengths),
        emitted=jnp.zeros_like(state.active),
        finish=jnp.zeros(state.active.shape, jnp.int8),
        top_ids=jnp.zeros(top_shape, jnp.int32),
        top_logprobs=jnp.zeros(top_shape, jnp.float32),
    )
