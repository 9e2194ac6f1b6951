"""The jitted device programs of a round, over the resident store of rows.

- `mixed_step`: one ragged step. A flat batch of tokens holds the next token of each decoding
  row (sampled here from the row's logits) followed by prefill chunks of other sequences; the
  model runs once over all of them, each token attending to its own sequence's pages
  (etjax/attention); under pruning the rows' tokens read only their kept blocks. Returns the
  logits after each chunk.
- `prefill_chunk`: the same flat prefill without rows to decode and without the store.
- `decode_steps`: K decode steps of a batch of rows in one `lax.scan`, for rounds with nothing
  to prefill (fewer host round trips).
- `first_token`: a new row's first token, drawn from its prompt's logits when the row is
  made, so it streams with the step that ran the prompt; the row's next step (either
  program) runs it, held `pending`, instead of drawing.

`mixed_step` and `decode_steps` gather their rows from the store and scatter them back inside
the program, and donate the store and the KV cache. Shapes: `mixed_step` by its token bucket,
`decode_steps` by its row bucket (and both, under pruning, by the rows' page-table and
kept-table widths); the host sizes every other array from the engine's fixed sizes, so a run
compiles a bounded set of programs once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
from jax.lax import with_sharding_constraint as constrain

from etjax.attention import XLA, AttentionBackend, AttentionPlan, SparsePlan
from etjax.cache.kv_cache import KVCache
from etjax.distributed.mesh import DATA, MODEL
from etjax.distributed.placement import Placement
from etjax.entropy.cost import CostModel
from etjax.experts.config import ExpertConfig
from etjax.model.config import ModelConfig
from etjax.model.products import row_products
from etjax.model.transformer import forward, logits_from_hidden
from etjax.model.weights import Weights
from etjax.pruning.budget import budget_entropy, kept_block_count, kept_fraction
from etjax.pruning.config import PruningThresholds
from etjax.pruning.groups import PrunedGroups, grouped_blocks
from etjax.runtime.commit import commit_tokens, draw_rows, finishes
from etjax.runtime.rollback import retract_rejected
from etjax.runtime.state import DecodeState, StepOutputs
from etjax.runtime.target_logprobs import target_logprobs
from etjax.runtime.token_mask import collect_masks, start_masks
from etjax.runtime.verify import accept_drafts, precomputes_logits, row_and_draft_logits


@dataclasses.dataclass(frozen=True)
class StepStatics:
    """What shapes the step programs of an engine, in one hashable value (their static jit
    argument): engines whose statics are equal share their compiled programs. Each program
    takes one more static of its own: `mixed_step` its drafts, `decode_steps` its steps."""

    cfg: ModelConfig
    cost: CostModel
    max_kept: int = 0  # under pruning, the blocks a row's token may read per layer, at most
    placement: Placement | None = None  # the mesh the arrays keep, or None on one device
    # Its attention kernels, and whether and how decode rows prune (`prunes`; the pruning's
    # thresholds are traced): etjax/attention/backend.py.
    attention_backend: AttentionBackend = XLA
    # Rows of the call are constrained: at most this many (a power of two; 0: none). Each
    # step masks their logits by their allowed tokens and asks the host for the next masks
    # (etjax/runtime/token_mask.py). Calls without one compile and run programs with none
    # of it.
    constrained: int = 0
    # Entropy-steered experts (etjax/experts): the rows' decode tokens run fewer routed
    # experts after a confident step. None: every token runs all k (engines with the setting
    # off share their programs whatever its numbers).
    experts: ExpertConfig | None = None


@flax.struct.dataclass
class FlatBatch:
    """The host-built part of a ragged step's flat batch. T = tokens, Bm = decoding rows
    (padded), Sp = prefill sequences (padded)."""

    tokens: jax.Array  # [T] int32 prefill tokens; decode slots are filled on the device
    positions: jax.Array  # [T] int32
    write_pages: jax.Array  # [T] int32 page of each token's position; null page for padding
    decode_slot: jax.Array  # [Bm] int32 flat index of each row's token (T for padding rows)
    last_index: jax.Array  # [Sp] int32 flat index of each prefill sequence's last token
    # [Bm] int32 tokens drafted after each row's token, in the slots that follow it (0 for a
    # row that does not speculate); the host writes them into `tokens`.
    draft_len: jax.Array
    # [T] int32 the context token after each prefill token, where its request asks for
    # prompt log-probabilities; -1 elsewhere (etjax/runtime/target_logprobs.py).
    targets: jax.Array


@functools.partial(
    jax.jit, static_argnames=("statics", "max_draft"), donate_argnames=("cache", "store")
)
def mixed_step(
    weights: Weights,
    cache: KVCache,
    store: DecodeState,
    rows: jax.Array,
    batch: FlatBatch,
    plan: AttentionPlan,
    page_table: jax.Array | None,
    thresholds: PruningThresholds | None,
    statics: StepStatics,
    max_draft: int = 0,
) -> tuple[DecodeState, KVCache, StepOutputs, jax.Array, jax.Array]:
    """One ragged step: every row in `rows` [Bm] (the store's pad row for padding) samples its
    next token, which runs through the model together with the prefill tokens of `batch`.

    With `max_draft` > 0, row j's token is followed in the flat batch by
    `batch.draft_len[j]` <= max_draft drafted tokens, run in the same pass and then verified
    (etjax/runtime/verify.py): the accepted ones are committed, with outputs [1 + max_draft,
    Bm] (emitted where committed); the page bounds forget the rejected keys
    (etjax/runtime/rollback.py).

    Dense, `plan` holds every token's attention work. Where `statics.attention_backend`
    prunes, the rows' tokens attend to the blocks their budgets keep under `thresholds`
    (traced: engines differing in them share the program), scored over their whole page
    tables `page_table` [Bm, W], and `plan` holds the chunks' work (and, on a model with
    sliding-window layers, every row token's local layers). A verifying row's drafts are
    pruned too, each as a plain pruned step at its position (`_per_token`).
    Returns the store, the cache, the rows' outputs [1, Bm], float32 logits [Sp, V] after
    each prefill sequence's last token (a new row draws its first token from them when it
    is inserted: `first_token`), and float32 [T] the log-probability of `batch.targets`
    after each token (0 where there is none).
    """
    with _tracing(statics.placement, statics.attention_backend):
        state = take_rows(store, rows).replace(page_table=page_table)
        row_slots = _row_slots(batch, max_draft)
        model = functools.partial(
            _run_ragged, weights, cache, store, batch, plan, statics, row_slots
        )
        start = state.lengths
        head = _verify_head(weights, rows, max_draft, statics)
        state, cache, outputs, after = _decode_step(
            weights, state, statics, thresholds, model, rows, batch.draft_len > 0, head=head
        )
        outputs = jax.tree.map(lambda x: x[None], outputs)
        if max_draft:
            state, cache, outputs = _verify_drafts(
                weights, cache, state, outputs, batch, row_slots, after, start, thresholds, statics
            )
        logits = logits_from_hidden(weights, after[0])  # after each prefill sequence
        store, cache, logits, _ = _placed(statics, put_rows(store, rows, state), cache, logits)
        return store, cache, outputs, logits, after[3]


@jax.jit
def first_token(state: DecodeState) -> tuple[DecodeState, StepOutputs]:
    """A new row's first token, drawn as soon as its prompt's logits exist (the host streams
    it when the step that ran the prompt's last chunk returns, instead of after the row's
    next step): `state` [B] (a row just made from the prompt, etjax/engine/row_store.py)
    draws from its logits and commits the token exactly as `_decode_step` would: the same
    sampler and key (the token's index in the output), entropy, controller, penalties. The
    token is held `pending`: the row's next step runs it instead of drawing, and that step
    computes what the token's pass reads and costs (its budget and kept blocks, its share
    of the weights' bytes, which the batch it runs in decides) and reports them for it, so
    here the cost is not charged and kept_blocks is 0. One program per vocabulary and eos
    count, whatever the engine. Returns the state and the outputs [1, B]."""
    take = state.active
    state, tokens, info, sampler_state = draw_rows(state)
    runs = take & ~finishes(state, tokens, take)
    unpaid = jnp.zeros(tokens.shape, jnp.float32)
    state, outputs = commit_tokens(
        state,
        tokens,
        info,
        sampler_state,
        take,
        state.logits,
        state.entropy.budget,
        jnp.zeros_like(tokens),
        unpaid,
        unpaid,
    )
    state = state.replace(lengths=state.lengths - runs, pending=jnp.where(runs, tokens, -1))
    return state, jax.tree.map(lambda x: x[None], outputs)


def _row_slots(batch: FlatBatch, max_draft: int) -> jax.Array:
    # Flat index of each row's token and its drafts [Bm, 1 + max_draft]; out of range
    # (dropped on writes, zeros on reads) past a row's drafts.
    num_tokens = batch.tokens.shape[0]
    offsets = jnp.arange(1 + max_draft)
    return jnp.where(
        offsets <= batch.draft_len[:, None], batch.decode_slot[:, None] + offsets, num_tokens
    )


def _run_ragged(
    weights, cache, store, batch, plan, statics, row_slots, tokens, runs, sparse, row_k
):
    # `_decode_step`'s model pass of a ragged step: the rows' tokens [Bm] (and their drafts,
    # already in the batch) with the prefill chunks. Returns the rows' hidden states [Bm, D],
    # the cache, and what the step needs after sampling: the prefill sequences' last hidden
    # states [Sp, D], the drafts' hidden states [Bm, max_draft, D], the pages each row's
    # tokens wrote [Bm, 1 + max_draft] and the targets' log-probabilities [T]. runs [Bm]:
    # rows that run on; row_k [Bm]: the experts each row's token runs (None: all); chunks and
    # drafts run all k.
    slot = batch.decode_slot
    if sparse is not None:
        pad_row = store.lengths.shape[0] - 1
        sparse = _per_token(sparse, row_slots, batch.positions, pad_row, statics.cost)
    flat = batch.tokens.at[slot].set(tokens, mode="drop")
    own, write_pages = _ragged_writes(batch, row_slots, runs)
    active_k = None
    if row_k is not None:
        active_k = jnp.full(batch.tokens.shape[0], statics.cfg.num_experts_per_tok, jnp.int32)
        active_k = active_k.at[slot].set(row_k, mode="drop")
    hidden, new_cache = forward(
        weights,
        cache,
        flat,
        batch.positions,
        write_pages,
        statics.cfg,
        plan=_attention(plan, sparse, statics),
        active_k=active_k,
    )
    rows_hidden = hidden.at[row_slots].get(mode="fill", fill_value=0)
    prompt_logprobs = target_logprobs(weights, hidden, batch.targets)
    after = (hidden[batch.last_index], rows_hidden[:, 1:], own, prompt_logprobs)
    return rows_hidden[:, 0], new_cache, after


def _ragged_writes(batch, row_slots, runs):
    # The pages the rows' tokens write [Bm, 1 + max_draft] and the flat batch's [T]: a row
    # that finished on this token (runs [Bm] false) writes nothing (its token and drafts are
    # not run).
    own = batch.write_pages.at[row_slots].get(mode="fill", fill_value=0)
    own = jnp.where(runs[:, None], own, 0)
    return own, batch.write_pages.at[row_slots].set(own, mode="drop")


def _verify_drafts(
    weights, cache, state, outputs, batch, row_slots, after, start, thresholds, statics
):
    # The rows' drafts checked after their tokens (etjax/runtime/verify.py). Returns the
    # state, the cache without the rejected drafts' keys (etjax/runtime/rollback.py) and the
    # outputs [1 + max_draft, Bm]. outputs [1, Bm]: the rows' tokens'; after: `_run_ragged`'s;
    # start [Bm]: the rows' lengths before the step.
    _, draft_hidden, row_pages, _, *joint = after  # joint: `_joint_head`'s draft logits
    fraction = state.entropy.budget  # the kept fraction the rows' tokens read with
    drafts = batch.tokens.at[row_slots[:, 1:]].get(mode="fill", fill_value=0)
    reads = None
    if statics.attention_backend.prunes:  # the drafts read their own kept blocks (_per_token)

        def reads(num_blocks):
            return fraction, _kept(fraction, num_blocks, thresholds, statics.max_kept)

    state, verified = accept_drafts(
        weights,
        state,
        drafts,
        batch.draft_len,
        draft_hidden,
        statics.cost,
        statics.constrained,
        reads,
        draft_logits=joint[0] if joint else None,
    )
    outputs = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), outputs, verified)
    written = jnp.sum(row_pages != 0, axis=1)
    cache = retract_rejected(cache, row_pages, start, written, state.lengths)
    return state, cache, outputs


def _verify_head(weights, rows, max_draft, statics):
    # A verifying step's LM head over its rows' tokens and their drafts at once
    # (`_joint_head`) where verify.py would compute the drafts' logits in one product anyway
    # (`precomputes_logits`); None: the plain head.
    if max_draft and precomputes_logits(rows.shape[0], max_draft, statics.constrained):
        return functools.partial(_joint_head, weights)
    return None


def _joint_head(weights, hidden, after):
    # A verifying step's LM head: its rows' tokens [B, D] and their drafts (in `after`) in
    # one product (verify.py `row_and_draft_logits`); the drafts' logits ride on in `after`.
    logits, draft_logits = row_and_draft_logits(weights, hidden, after[1])
    return logits, (*after, draft_logits)


def _placed(statics, store, cache, logits=None, outputs=None):
    # A program's results in the shardings the engine keeps them in (as they are on one
    # device): logits [S, V] over data and model, the store, the cache, outputs [K, B].
    placement = statics.placement
    if placement is None:
        return store, cache, logits, outputs
    if logits is not None:
        logits = constrain(logits, placement.sharding(logits.shape, {0: DATA, 1: MODEL}))
    store = constrain(store, placement.state(store, statics.cfg.vocab_size))
    cache = constrain(cache, placement.cache(cache))
    if outputs is not None:
        outputs = constrain(outputs, placement.outputs(outputs))
    return store, cache, logits, outputs


@functools.partial(jax.jit, static_argnames=("cfg", "placement"), donate_argnames="cache")
def prefill_chunk(
    weights: Weights,
    cache: KVCache,
    tokens: jax.Array,
    positions: jax.Array,
    write_pages: jax.Array,
    last_index: jax.Array,
    plan: AttentionPlan,
    cfg: ModelConfig,
    placement: Placement | None = None,
) -> tuple[jax.Array, KVCache]:
    """Append prompt chunks of several sequences, flattened into one batch of tokens; return
    the logits after each sequence's last token. Without rows to decode: teacher-forced
    perplexity (etjax/bench) and benchmarks prefill with it; the engine uses `mixed_step`.

    tokens, positions, write_pages: [T] int32 (padding tokens write to the null page);
    last_index: [S] int32 flat index of each sequence's last token; plan: the attention work
    (each token reads its own sequence's pages up to its position). `placement`: the mesh
    shardings the cache and logits keep (etjax/distributed), or None on one device.
    Returns float32 logits [S, V] and the updated cache.
    """
    with _tracing(placement, plan.backend):
        hidden, cache = forward(weights, cache, tokens, positions, write_pages, cfg, plan=plan)
        logits = logits_from_hidden(weights, hidden[last_index])
        if placement is not None:
            logits = constrain(logits, placement.sharding(logits.shape, {0: DATA, 1: MODEL}))
            cache = constrain(cache, placement.cache(cache))
        return logits, cache


@contextlib.contextmanager
def _tracing(placement: Placement | None, backend: AttentionBackend):
    # While tracing: mesh-aware code (the sharded top-k) sees the placement's mesh; on one CPU
    # device with the C++ kernels (the "cpu" backend), projections of a few rows run the
    # row-products kernel (etjax/model/products.py).
    with contextlib.ExitStack() as stack:
        if placement is not None:
            stack.enter_context(placement.tracing())
        stack.enter_context(row_products(backend.name == "cpu" and placement is None))
        yield


@functools.partial(
    jax.jit, static_argnames=("statics", "num_steps"), donate_argnames=("cache", "store")
)
def decode_steps(
    weights: Weights,
    cache: KVCache,
    store: DecodeState,
    rows: jax.Array,
    page_table: jax.Array,
    page_base: jax.Array,
    plan: AttentionPlan | None,
    thresholds: PruningThresholds | None,
    statics: StepStatics,
    num_steps: int,
    groups: PrunedGroups | None = None,
) -> tuple[DecodeState, KVCache, StepOutputs]:
    """Run `num_steps` steps of: sample from each row's logits, then run the model on it.

    rows: [B] int32 store rows (the pad row for padding). page_table: [B, W] int32 pages of
    each row from logical page `page_base` [B] on: under pruning the whole table (base 0), for
    the block selection; dense, just the pages the burst writes to. A row finishes when it
    samples an eos id (unless `stop_on_eos` is off) or reaches its `max_new_tokens`; a
    finished row is not run again. Where `statics.attention_backend` prunes, the pass of a
    token reads at most `statics.max_kept` blocks per layer (and KV head), and as many as
    `thresholds` and the entropy of the distribution the token was drawn from allows (the
    budget of step t comes from what step t - 1 computed). `plan`: the dense attention work
    of the burst, one decode token per row with items up to each row's length after the
    burst (etjax/attention); required unless pruning, and under pruning on a model with
    sliding-window layers, whose local layers read each row's window through its local
    passes (None otherwise). `groups`: under pruning, rows sharing a prefix that select its
    blocks together and read them once (etjax/pruning/groups.py); None: each row alone.
    With a `statics.placement`, the store, cache and outputs keep its shardings (rows over
    `data`, logits over `model` too). Returns the store, the cache, and outputs [K, B].
    """
    with _tracing(statics.placement, statics.attention_backend):
        state = take_rows(store, rows).replace(page_table=page_table)
        step = functools.partial(
            _burst_step, weights, rows, page_base, plan, thresholds, statics, groups
        )
        (state, cache), outputs = jax.lax.scan(step, (state, cache), None, length=num_steps)
        store = put_rows(store, rows, state)
        store, cache, _, outputs = _placed(statics, store, cache, outputs=outputs)
        return store, cache, outputs


def _burst_step(weights, rows, page_base, plan, thresholds, statics, groups, carry, _):
    # One step of a burst (a `lax.scan` body): carry (state [B], cache) -> the carry and the
    # step's outputs [B].
    state, cache = carry
    model = functools.partial(_run_burst, weights, cache, state, page_base, plan, statics)
    state, cache, outputs, _ = _decode_step(
        weights, state, statics, thresholds, model, rows, groups=groups
    )
    return (state, cache), outputs


def _run_burst(weights, cache, state, page_base, plan, statics, tokens, runs, sparse, row_k):
    # `_decode_step`'s model pass of a burst step: each row's token [B] at its length,
    # written where the row runs on (runs [B]) to the page of its table (which starts at
    # logical page page_base [B]) that the position falls in. Returns the hidden states
    # [B, D], the cache and nothing after.
    cfg, page_size = statics.cfg, statics.cost.page_size
    logical = state.lengths // page_size - page_base
    width = state.page_table.shape[1]
    pages = jnp.take_along_axis(state.page_table, jnp.clip(logical, 0, width - 1)[:, None], 1)
    write_pages = jnp.where(runs, pages[:, 0], 0)

    def run() -> tuple[jax.Array, KVCache]:
        return forward(
            weights,
            cache,
            tokens,
            state.lengths,
            write_pages,
            cfg,
            plan=_attention(plan, sparse, statics),
            active_k=row_k,
        )

    def idle() -> tuple[jax.Array, KVCache]:
        return jnp.zeros((tokens.shape[0], cfg.hidden_size), cfg.jnp_dtype), cache

    # Once every row of the burst has finished (a request of one new token, the steps after
    # a batch's last row ends), its remaining steps skip the model.
    hidden, cache_after = jax.lax.cond(jnp.any(runs), run, idle)
    return hidden, cache_after, None


def _attention(plan, sparse, statics):
    # The plan the model attends with: the host's (None: a burst of pruned rows only, with no
    # dense work) holding the rows' pruned part (None dense).
    if plan is None:
        plan = AttentionPlan(passes=(), backend=statics.attention_backend)
    return plan.replace(sparse=sparse)


def _decode_step(
    weights, state, statics, thresholds, run_model, rows, verifying=None, groups=None, head=None
):
    # One step of every row of `state`: sample from its logits, run the model on the token
    # (`run_model(tokens [B], runs [B], sparse, row_k) -> (hidden [B, D], cache, after)`,
    # row_k [B] the experts each token runs or None for all), account.
    # Returns the state, the cache, the outputs and `after`, what run_model passed on.
    # `rows` [B]: the store rows of `state` (whose block mass pruning reads). `verifying` [B]
    # bool: rows whose drafts run after their token (which then runs all k experts). `groups`:
    # pruned rows sharing a prefix (etjax/pruning/groups.py), or None. `head(hidden, after)
    # -> (next logits [B, V], after)`: a verifying step's LM head (`_joint_head`), or None.
    # A row holding a `pending` token (its first, committed when its row was made:
    # `first_token`) runs that token instead of a new draw and commits nothing; its pass
    # reads the budget and experts its draw's distribution gives, as a drawing step's would,
    # is charged here, and its outputs report that (budget, kept_blocks, cost) for it.
    cost, active, raw_logits = statics.cost, state.active, state.logits
    pending = None if state.pending is None else active & (state.pending >= 0)
    take = active if pending is None else active & ~pending  # rows that commit a token
    # Under a grammar the raw logits stay the entropy signal's (`draw_rows`).
    state, tokens, info, sampler_state = draw_rows(state, statics.constrained)
    if pending is not None:
        tokens = jnp.where(pending, state.pending, tokens)
    if statics.constrained:
        # The host computes the next masks while the model runs on `tokens` (collected below).
        tokens, ticket = start_masks(
            state.grammar, tokens, state.num_generated, take, state.allowed.shape[1]
        )
    runs = take & ~finishes(state, tokens, take)
    if pending is not None:
        runs = runs | pending
    num_blocks = (state.lengths + cost.page_size) // cost.page_size  # with the new token
    fraction, kept, sparse, spared = _budget(
        state, statics, thresholds, raw_logits, info, num_blocks, rows, groups
    )
    row_k = _row_experts(statics, info, verifying)
    hidden, cache, after = run_model(tokens, runs, sparse, row_k)
    if head is not None:
        next_logits, after = head(hidden, after)
    else:  # the LM head only where a row runs on (its logits are kept only there)
        next_logits = jax.lax.cond(
            jnp.any(runs), lambda: logits_from_hidden(weights, hidden), lambda: state.logits
        )
    if statics.constrained:  # after the model's pass, which the host's masks overlapped
        allowed = collect_masks(ticket, next_logits, *state.allowed.shape)
    flops, nbytes = cost.token_cost(
        (kept * cost.page_size).astype(jnp.float32),
        runs,
        (num_blocks * cost.page_size).astype(jnp.float32),
        row_k,
    )
    state, outputs = commit_tokens(
        state, tokens, info, sampler_state, take, next_logits, fraction, kept, flops, nbytes
    )
    if pending is not None:  # the pending token ran: the row is as if it had drawn it here
        state = state.replace(
            logits=jnp.where(pending[:, None], next_logits, state.logits),
            lengths=state.lengths + pending,
            pending=jnp.where(pending, -1, state.pending),
            entropy=state.entropy.replace(
                budget=jnp.where(pending, fraction, state.entropy.budget)
            ),
        )
        kept_blocks = jnp.where(pending, kept, outputs.kept_blocks).astype(jnp.int32)
        outputs = outputs.replace(kept_blocks=kept_blocks)
    if statics.constrained:
        state = state.replace(allowed=allowed)
    if groups is not None:
        outputs = outputs.replace(spared_blocks=jnp.where(runs, spared, 0.0))
    return state, cache, outputs, after


def _budget(state, statics, thresholds, raw_logits, info, num_blocks, rows, groups):
    # What the rows' tokens read: their kept fraction [B], kept blocks [B] (num_blocks [B]
    # dense), the SparsePlan of their pass (None dense) and, with `groups`, the blocks the
    # group read for each row [B] (None otherwise).
    backend, max_kept = statics.attention_backend, statics.max_kept
    if not backend.prunes:
        return jnp.ones_like(info.model_entropy), num_blocks, None, None
    # The calibrated signal (the model entropy itself without a calibration).
    signal = budget_entropy(
        raw_logits, info.calibrated_entropy, backend.pruning, state.calibration.temperature
    )
    fraction = kept_fraction(signal, thresholds)
    kept = _kept(fraction, num_blocks, thresholds, max_kept)
    sparse = SparsePlan(
        budget_blocks=kept,
        page_table=state.page_table,
        rows=rows,
        thresholds=thresholds,
        max_kept=max_kept,
        fraction=fraction,
        groups=groups,
    )
    spared = None
    if groups is not None:  # the group's blocks and its own; the group's read once
        kept, spared = grouped_blocks(fraction, num_blocks, groups, thresholds)
        kept = jnp.minimum(kept, max_kept)
    return fraction, kept, sparse, spared


def _row_experts(statics, info, verifying):
    # [B] int32 the routed experts each row's token runs, or None (all k, or no experts to
    # steer). They follow the signal of the distribution the token was drawn from
    # (etjax/experts); a verifying row's token (verifying [B] bool), like its drafts, runs
    # all k.
    if statics.experts is None:
        return None
    top_k = statics.cfg.num_experts_per_tok
    row_k = statics.experts.active_k(info.calibrated_entropy, top_k)
    if verifying is not None:
        row_k = jnp.where(verifying, top_k, row_k)
    return row_k


def _kept(fraction, num_blocks, thresholds, max_kept):
    # Blocks a token reads: its kept fraction of `num_blocks`, with the floors, at most the
    # kept table's width.
    return jnp.minimum(kept_block_count(fraction, num_blocks, thresholds), max_kept)


def _per_token(
    sparse: SparsePlan,
    row_slots: jax.Array,
    positions: jax.Array,
    pad_row: int,
    cost: CostModel,
) -> SparsePlan:
    # A ragged step's pruned tokens: every token of a row, its drafts too (row_slots [B, n]:
    # flat indices, out of range past a row's drafts), each as a row of its own. A token
    # reads what a plain pruned step at its position would: the row's page table, its own
    # query's kept blocks, as many as the row's kept fraction gives at its position (the
    # fraction from the entropy the row's token was drawn from, as the drafts' own are not
    # known before this pass). Only a row's first token remembers the mass it drew.
    n = row_slots.shape[1]
    slots = row_slots.reshape(-1)
    position = positions.at[slots].get(mode="fill", fill_value=0)
    num_blocks = (position + cost.page_size) // cost.page_size  # with the token's own
    fraction = jnp.repeat(sparse.fraction, n)
    kept = _kept(fraction, num_blocks, sparse.thresholds, sparse.max_kept)
    first = jnp.arange(slots.shape[0]) % n == 0
    rows = sparse.rows if sparse.rows is not None else jnp.arange(row_slots.shape[0])
    return sparse.replace(
        budget_blocks=kept,
        page_table=jnp.repeat(sparse.page_table, n, axis=0),
        rows=jnp.where(first, jnp.repeat(rows, n), pad_row).astype(jnp.int32),
        slots=slots,
        fraction=fraction,
    )


def take_rows(store: DecodeState, rows: jax.Array) -> DecodeState:
    """The state of store rows `rows` [B]; the shared eos ids ride along, the page table is
    the caller's (None)."""
    body = jax.tree.map(lambda s: s[rows], store.replace(eos_ids=None, page_table=None))
    return body.replace(eos_ids=store.eos_ids, page_table=None)


def put_rows(store: DecodeState, rows: jax.Array, batch: DecodeState) -> DecodeState:
    """Scatter `batch` [B] into store rows `rows` [B]. Pad rows all point at the store's last
    row: whichever write wins there is harmless, it is never active."""
    shared = dict(eos_ids=store.eos_ids, page_table=store.page_table)
    body = jax.tree.map(
        lambda s, b: s.at[rows].set(b.astype(s.dtype)),
        store.replace(eos_ids=None, page_table=None),
        batch.replace(eos_ids=None, page_table=None),
    )
    return body.replace(**shared)
