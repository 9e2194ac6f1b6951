"""The jitted device programs: prefill chunks, and K decode steps in one `lax.scan`.

Both donate the KV cache so pages are updated in place. Shapes are bucketed by the caller
(`buckets.py`), so a run with varied prompts compiles a handful of programs once.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
from jax.lax import with_sharding_constraint as constrain

from etjax.attention import AttentionPlan
from etjax.cache.kv_cache import KVCache, token_pages
from etjax.distributed.mesh import DATA, MODEL
from etjax.distributed.placement import Placement
from etjax.entropy.cost import CostModel
from etjax.entropy.state import advance_tau
from etjax.model.config import ModelConfig
from etjax.model.transformer import SparsePlan, forward, logits_from_hidden
from etjax.model.weights import Weights
from etjax.pruning.budget import budget_entropy, kept_block_count, kept_fraction
from etjax.pruning.config import PruningConfig
from etjax.runtime.state import DecodeState, StepOutputs
from etjax.sampling.sampler import sample_next


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
    the logits after each sequence's last token.

    tokens, positions, write_pages: [T] int32 (padding tokens write to the null page);
    last_index: [S] int32 flat index of each sequence's last token; plan: the attention work
    (each token reads its own sequence's pages up to its position). `placement`: the mesh
    shardings the cache and logits keep (etjax/distributed), or None on one device.
    Returns float32 logits [S, V] and the updated cache.
    """
    with _on_mesh(placement):
        hidden, cache = forward(weights, cache, tokens, positions, write_pages, cfg, plan=plan)
        logits = logits_from_hidden(weights, hidden[last_index])
        if placement is not None:
            logits = constrain(logits, placement.sharding(logits.shape, {0: DATA, 1: MODEL}))
            cache = constrain(cache, placement.cache(cache))
        return logits, cache


def _on_mesh(placement: Placement | None):
    # While tracing: let mesh-aware code (the sharded top-k) see the placement's mesh.
    return contextlib.nullcontext() if placement is None else placement.tracing()


DENSE = PruningConfig()  # pruning disabled: every block of the context is read


@functools.partial(
    jax.jit,
    static_argnames=("cfg", "cost", "num_steps", "pruning", "max_kept", "placement"),
    donate_argnames=("cache", "state"),
)
def decode_steps(
    weights: Weights,
    cache: KVCache,
    state: DecodeState,
    cfg: ModelConfig,
    cost: CostModel,
    num_steps: int,
    pruning: PruningConfig = DENSE,
    max_kept: int = 0,
    placement: Placement | None = None,
    plan: AttentionPlan | None = None,
) -> tuple[DecodeState, KVCache, StepOutputs]:
    """Run `num_steps` steps of: sample from each active row's logits, then run the model on it.

    A row finishes when it samples an eos id (unless `stop_on_eos` is off) or reaches its
    `max_new_tokens`; a finished row is not run again. With `pruning.enabled`, the forward pass
    of a token reads at most `max_kept` blocks per layer (and KV head), and as many as the
    entropy of the distribution the token was drawn from allows (the budget of step t comes
    from what step t - 1 computed). With a `placement`, the state, cache and outputs are held
    in its shardings on the way in and out (rows over `data`, logits over `model` too).
    `plan`: the dense attention work of the burst, one decode token per row with items up to
    each row's length after the burst (etjax/attention); required unless pruning.
    Returns the new state, the cache, and per-step outputs [num_steps, B].
    """
    with _on_mesh(placement):
        if placement is not None:
            state = constrain(state, placement.state(state, cfg.vocab_size))
        state, cache, outputs = _scan_steps(
            weights, cache, state, cfg, cost, num_steps, pruning, max_kept, plan
        )
        if placement is not None:
            state = constrain(state, placement.state(state, cfg.vocab_size))
            cache = constrain(cache, placement.cache(cache))
            outputs = constrain(outputs, placement.outputs(outputs))
        return state, cache, outputs


def _scan_steps(weights, cache, state, cfg, cost, num_steps, pruning, max_kept, plan):
    def step(carry: tuple[DecodeState, KVCache], _: None):
        state, cache = carry
        active = state.active
        tokens, info, sampler_state = sample_next(
            state.logits,
            state.sampler,
            state.entropy.sampler,
            state.token_counts,
            state.in_prompt,
            state.num_generated,
        )
        num_generated = state.num_generated + active
        hit_eos = state.stop_on_eos & jnp.any(tokens[:, None] == state.eos_ids, axis=-1)
        runs = active & ~(hit_eos | (num_generated >= state.max_new_tokens))

        num_blocks = (state.lengths + cost.page_size) // cost.page_size  # with the new token
        if pruning.enabled:
            signal = budget_entropy(state.logits, info.model_entropy, pruning)
            fraction = kept_fraction(signal, pruning)
            kept = jnp.minimum(kept_block_count(fraction, num_blocks, pruning), max_kept)
            sparse = SparsePlan(
                budget_blocks=kept,
                page_table=state.page_table,
                pruning=pruning,
                max_kept=max_kept,
            )
        else:
            fraction, kept, sparse = jnp.ones_like(info.model_entropy), num_blocks, None
        write_pages = token_pages(state.page_table, state.lengths, runs, cost.page_size)
        hidden, cache = forward(
            weights,
            cache,
            tokens,
            state.lengths,
            write_pages,
            cfg,
            plan=None if sparse is not None else plan,
            sparse=sparse,
        )
        flops, nbytes = cost.token_cost((kept * cost.page_size).astype(jnp.float32), runs)
        entropy = advance_tau(state.entropy, info.model_entropy, active)
        entropy = entropy.replace(
            budget=jnp.where(active, fraction, entropy.budget),
            sampled_entropy=jnp.where(active, info.sampled_entropy, entropy.sampled_entropy),
            temperature=jnp.where(active, info.temperature, entropy.temperature),
            cost_flops=entropy.cost_flops + flops,
            cost_bytes=entropy.cost_bytes + nbytes,
            sampler=sampler_state,
        )
        rows = jnp.arange(tokens.shape[0])
        state = state.replace(
            logits=logits_from_hidden(weights, hidden),
            lengths=state.lengths + runs,
            num_generated=num_generated,
            active=runs,
            token_counts=state.token_counts.at[rows, tokens].add(active.astype(jnp.int32)),
            entropy=entropy,
        )
        outputs = StepOutputs(
            tokens=tokens,
            model_entropy=info.model_entropy,
            logprob=info.logprob,
            sampled_entropy=info.sampled_entropy,
            temperature=info.temperature,
            tau=entropy.tau,
            cost_flops=entropy.cost_flops,
            cost_bytes=entropy.cost_bytes,
            kept_blocks=jnp.where(runs, kept, 0).astype(jnp.int32),
            emitted=active,
        )
        return (state, cache), outputs

    (state, cache), outputs = jax.lax.scan(step, (state, cache), None, length=num_steps)
    return state, cache, outputs
