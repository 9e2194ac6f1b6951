"""Entropic speculation: drafted tokens verified in the ragged step change no output.

The truth is the engine without speculation: verification re-samples each drafted position
exactly as the plain step would (etjax/runtime/verify.py), so greedy and sampled outputs must
be the same token for token, for every sampler. Plus the host parts by hand: prompt lookup,
the draft-length rule, and the settings' errors.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import numpy as np
import pytest

from etjax.drafting import (
    DraftHistory,
    SpeculationConfig,
    StepCosts,
    TokenHistory,
    lookup_draft,
    matched_tail,
)
from etjax.drafting.rule import (
    COPY_ACCEPTANCE,
    ONE_TOKEN_TAIL_ACCEPTANCE,
    draft_lengths,
    expected_accepted,
    record_verification,
    verification_pays,
    wanted_length,
)
from etjax.engine_build import MIN_POOL_PAGES, build_engine
from etjax.errors import ConfigError
from etjax.run_config import load_run_config
from etjax.runtime.options import RequestSettings, RuntimeOptions
from etjax.sampling import SamplerSettings

# Verifying as an accelerator would (a pass's fixed cost large against a few tokens' compute):
# every round that can draft does, so these tests exercise verification whatever this CPU's
# cost gate would decide (test_draft_lengths_follow_entropy_acceptance_and_budget has it).
EAGER = dict(pass_fixed_tokens=1000.0, measured_costs=False)
SPEC = SpeculationConfig(enabled=True, **EAGER)


def _generate(model, prompts, settings, speculation, **engine):
    options = RuntimeOptions(speculation=speculation, **engine)
    built = build_engine(model.weights, model.config, model.tokenizer, options, MIN_POOL_PAGES)
    return built.generate(prompts, settings)


def _repetitive_texts(lee) -> list[str]:
    # A paragraph the model copies (drafts come from it), a verse it completes, and a prompt
    # with nothing to copy.
    paragraph = lee[3][:400]
    verse = "Twinkle, twinkle, little star, how I wonder what you are. "
    return [
        f"Text: {paragraph}\nCopy of the text: {' '.join(paragraph.split()[:4])}",
        verse * 4 + "Twinkle, twinkle,",
        "The history of the river valley begins",
    ]


def _repetitive(tokenizer, lee) -> list[list[int]]:
    return [tokenizer.encode(text) for text in _repetitive_texts(lee)]


GREEDY_NEW = 16  # the copied paragraph drafts from its first round: 13 of 17 drafts accepted


@pytest.fixture(scope="module")
def plain_greedy(smollm2, lee):
    """The engine's greedy outputs of `_repetitive` without speculation: the truth of the
    greedy test and of decode()'s (whose engine has these programs' shapes), run once."""
    prompts = _repetitive(smollm2.tokenizer, lee)
    settings = [RequestSettings(max_new_tokens=GREEDY_NEW, ignore_eos=True)] * len(prompts)
    return prompts, _generate(smollm2, prompts, settings, SpeculationConfig())


@pytest.mark.compile_bound  # etjax against etjax: compiles cheaply (tests/compile_level.py)
def test_greedy_with_speculation_equals_greedy_without(smollm2, plain_greedy):
    prompts, plain = plain_greedy
    settings = [RequestSettings(max_new_tokens=GREEDY_NEW, ignore_eos=True)] * len(prompts)
    spec = _generate(smollm2, prompts, settings, SPEC)
    for a, b in zip(plain, spec, strict=True):
        assert b.token_ids == a.token_ids
        np.testing.assert_allclose(b.entropy, a.entropy, rtol=1e-3, atol=1e-4)
    # The copied paragraph really was drafted and mostly accepted, in fewer passes than
    # tokens (measured: 17 drafted, 76% accepted, 0.19 passes per token).
    copy = spec[0].metrics
    assert copy["drafted_tokens"] > 0 and copy["acceptance_rate"] > 0.5
    assert copy["passes_per_token"] < 0.6
    assert all(o.metrics["passes_per_token"] <= 1.0 for o in spec)


@pytest.mark.parametrize(
    "sampler",
    [
        SamplerSettings(temperature=0.7, top_p=0.9, seed=11),
        (  # a fixed target beside one tracking its temperature's entropy
            SamplerSettings(sampler="entropic", target_entropy=1.0, seed=12),
            SamplerSettings(
                sampler="entropic", temperature=0.7, target_from_temperature=True, seed=12
            ),
        ),
        SamplerSettings(sampler="mirostat_v2", mirostat_tau=2.0, seed=13),
        SamplerSettings(temperature=0.8, repetition_penalty=1.1, top_k=20, seed=14),
    ],
    ids=["top_p", "entropic", "mirostat", "penalty_top_k"],
)
@pytest.mark.compile_bound  # etjax against etjax: its sampler's program compiles cheaply
def test_sampling_with_speculation_draws_the_same_tokens(smollm2, lee, sampler):
    # Verification draws each position with the row's own key, sampler state and logits, so
    # every seeded draw is the one the plain engine makes: its distribution is the plain one.
    prompts = _repetitive(smollm2.tokenizer, lee)[:2]
    pair = sampler if isinstance(sampler, tuple) else (sampler, sampler)
    settings = [RequestSettings(max_new_tokens=9, ignore_eos=True, sampler=s) for s in pair]
    loose = SpeculationConfig(enabled=True, entropy_max=20.0, acceptance_prior=0.9, **EAGER)
    plain = _generate(smollm2, prompts, settings, SpeculationConfig())
    spec = _generate(smollm2, prompts, settings, loose)
    for a, b in zip(plain, spec, strict=True):
        assert b.token_ids == a.token_ids
        np.testing.assert_allclose(b.temperature, a.temperature, rtol=1e-3, atol=1e-4)
    assert sum(o.metrics["drafted_tokens"] for o in spec) > 0
    assert any(o.metrics["passes_per_token"] < 1.0 for o in spec)  # some drafts accepted


def _oracle(prompts, plain, vocab_size, counter=None):
    # Drafts for a tiny random model, which copies nothing: the plain run's own next tokens,
    # with every third drafted token made wrong (prompts with no plain run draft nothing).
    def lookup(context, length, ngram_max, ngram_min):
        for prompt, out in zip(prompts, plain, strict=False):
            if context[: len(prompt)].tolist() == prompt:
                done = len(context) - len(prompt)
                draft = list(out.token_ids[done : done + length])
                for i in range(2, len(draft), 3):
                    draft[i] = (draft[i] + 1) % vocab_size
                if counter is not None:
                    counter[0] += max(len(draft) - 1, 0)
                return draft
        return []

    return lookup


FORCED = SpeculationConfig(enabled=True, entropy_max=100.0, acceptance_prior=0.9, **EAGER)
# Three drafts a lookup, the third wrong (`_oracle`): a row's token and its drafts fill 4
# slots, and a run compiles fewer verifying steps than with 7 drafts in 8 slots (the pruned
# test: 13 programs where 15).
FORCED_3 = dataclasses.replace(FORCED, max_draft=3)


def test_verification_accepts_right_drafts_and_rejects_wrong_ones_beside_prefill(
    tiny_hf_dir, monkeypatch
):
    # Right drafts must be accepted up to the first wrong one, wrong ones rejected, while a
    # long prompt prefills in 16-token chunks in the same steps; outputs stay the plain
    # engine's, and the rejected drafts' compute is charged.
    import etjax
    import etjax.engine.engine as engine_module

    tiny = etjax.load_model(tiny_hf_dir("llama"))
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, tiny.config.vocab_size, size=n).tolist() for n in (12, 90)]
    settings = [RequestSettings(max_new_tokens=24, ignore_eos=True)] * 2
    engine = dict(page_size=4, prefill_chunk=16)
    plain = _generate(tiny, prompts, settings, SpeculationConfig(), **engine)
    drafted = [0]
    oracle = _oracle(prompts, plain, tiny.config.vocab_size, drafted)
    monkeypatch.setattr(engine_module, "lookup_draft", oracle)
    spec = _generate(tiny, prompts, settings, FORCED, **engine)
    for a, b in zip(plain, spec, strict=True):
        assert b.token_ids == a.token_ids
        np.testing.assert_allclose(b.entropy, a.entropy, rtol=1e-4, atol=1e-5)
    assert drafted[0] > 0
    assert all(0 < o.metrics["acceptance_rate"] < 1 for o in spec)
    assert all(o.metrics["passes_per_token"] < 1 for o in spec)
    assert all(b.cost_flops[-1] > a.cost_flops[-1] for a, b in zip(plain, spec, strict=True))
    # Every third token of a lookup is wrong: a verifying pass accepts at most one draft,
    # but the first, which runs the row's pending first token with the whole lookup after
    # it, at most two.
    for o in spec:
        m = o.metrics
        assert 0 < m["mean_accepted_length"] * m["verify_steps"] <= m["verify_steps"] + 1
        accepted = m["acceptance_rate"] * m["drafted_tokens"]
        assert m["mean_accepted_length"] * m["verify_steps"] == pytest.approx(accepted)


def test_rollback_leaves_the_cache_and_allocator_as_a_plain_run(tiny_hf_dir, monkeypatch):
    # Compare states: after a run whose drafts were often rejected (also past the end of the
    # output), the sequence's cached keys and values, the key bounds of every page it held
    # and the remembered mass are those of the run without speculation, and at every length
    # both runs reached when picking the row, it held as many pages.
    import etjax
    import etjax.engine.engine as engine_module
    from etjax.cache.page_allocator import pages_needed

    tiny = etjax.load_model(tiny_hf_dir("llama"))
    prompt = np.random.default_rng(8).integers(3, tiny.config.vocab_size, size=13).tolist()
    settings = [RequestSettings(max_new_tokens=27, ignore_eos=True)]
    engine_options = RuntimeOptions(page_size=4)

    def run(speculation):
        options = dataclasses.replace(engine_options, speculation=speculation)
        engine = build_engine(tiny.weights, tiny.config, tiny.tokenizer, options, MIN_POOL_PAGES)
        held, held_at = [], {}
        release, pick = engine._release, engine._pick_batch

        def recording_release(seq):
            held.extend(seq.pages)
            release(seq)

        def recording_pick(running):
            batch = pick(running)
            held_at.update({s.length: len(s.pages) for s in batch})
            return batch

        monkeypatch.setattr(engine, "_release", recording_release)
        monkeypatch.setattr(engine, "_pick_batch", recording_pick)
        (out,) = engine.generate([prompt], settings)
        # Everything back but the null page.
        assert engine.page_cache.num_free == MIN_POOL_PAGES - 1
        return out, jax.device_get(engine.backend.cache), held, held_at

    plain, plain_cache, plain_pages, plain_held = run(SpeculationConfig())
    monkeypatch.setattr(
        engine_module, "lookup_draft", _oracle([prompt], [plain], tiny.config.vocab_size)
    )
    spec, spec_cache, spec_pages, spec_held = run(FORCED)
    assert spec.token_ids == plain.token_ids
    assert spec.metrics["acceptance_rate"] < 1 and spec.metrics["passes_per_token"] < 1

    length = len(prompt) + len(plain.token_ids) - 1  # the last token is not run
    pages = min(len(plain_pages), len(spec_pages))
    assert pages >= pages_needed(length, 4)
    a, b = np.asarray(plain_pages[:pages]), np.asarray(spec_pages[:pages])
    positions = np.arange(length)
    for field in ("k", "v"):  # [layers, pages, kv heads, page_size, hd], below the length
        cached = [
            getattr(c, field)[:, p[positions // 4], :, positions % 4]
            for c, p in ((plain_cache, a), (spec_cache, b))
        ]
        np.testing.assert_allclose(cached[1], cached[0], rtol=1e-4, atol=1e-5)
    bounds = ("k_min", "k_max")
    chex.assert_trees_all_close(
        {f: getattr(spec_cache, f)[:, b] for f in bounds},
        {f: getattr(plain_cache, f)[:, a] for f in bounds},
        rtol=1e-4,
        atol=1e-5,
    )
    # The block mass is the row's (both runs use row 0), by block.
    chex.assert_trees_all_close(spec_cache.block_mass, plain_cache.block_mass, atol=1e-5)
    # (Few: the first round verifies, so the two runs pick the row at different lengths.)
    common = plain_held.keys() & spec_held.keys()
    assert len(common) >= 1
    assert {n: spec_held[n] for n in common} == {n: plain_held[n] for n in common}


def test_pruned_engine_verifies_drafts_as_pruned_steps_would(tiny_hf_dir, monkeypatch):
    # Under pruning, a row verifying drafts stays pruned: each of its tokens reads what a
    # plain pruned step at its position reads. With a budget that keeps every block the
    # outputs are the dense engine's; with a budget that does not depend on the entropy (the
    # ramp above the random model's entropy, no mass ranking) the drafting row's tokens and
    # kept blocks are those of the same engine without speculation. A row that never
    # drafts stays pruned beside it, with mass ranking too.
    import etjax
    import etjax.engine.engine as engine_module
    from etjax.pruning.config import PruningConfig

    tiny = etjax.load_model(tiny_hf_dir("llama"))
    rng = np.random.default_rng(9)
    prompts = [rng.integers(3, tiny.config.vocab_size, size=n).tolist() for n in (40, 70)]
    settings = [RequestSettings(max_new_tokens=20, ignore_eos=True)] * 2
    # Both prompts prefill in one step: in 16-token chunks each chunk's wider page table would
    # compile each pruning's programs again (drafts beside prefill chunks are the test above's).
    engine = dict(page_size=4)
    dense = _generate(tiny, prompts, settings, SpeculationConfig(), **engine)
    # The random model's entropy is near log V (10.8 nats): ramp above it to prune.
    pruned = PruningConfig(
        enabled=True, entropy_low=20.0, entropy_high=30.0, min_blocks=2, recent_blocks=1
    )
    flat = dataclasses.replace(pruned, mass_threshold=0.0)
    pruned_only = _generate(tiny, prompts, settings, SpeculationConfig(), pruning=pruned, **engine)
    flat_only = _generate(tiny, prompts, settings, SpeculationConfig(), pruning=flat, **engine)
    assert sum(pruned_only[1].kept_blocks) < 0.5 * sum(dense[1].kept_blocks)

    # Drafts for the first prompt only.
    monkeypatch.setattr(
        engine_module, "lookup_draft", _oracle(prompts[:1], dense[:1], tiny.config.vocab_size)
    )
    keep_all = dataclasses.replace(pruned, min_fraction=1.0)
    both = _generate(tiny, prompts, settings, FORCED_3, pruning=keep_all, **engine)
    for a, b in zip(dense, both, strict=True):
        assert b.token_ids == a.token_ids
        np.testing.assert_allclose(b.entropy, a.entropy, rtol=1e-4, atol=1e-5)
    assert both[0].metrics["passes_per_token"] < 1

    # Drafts that continue the pruned engine's own outputs, so they are accepted.
    monkeypatch.setattr(
        engine_module, "lookup_draft", _oracle(prompts[:1], flat_only[:1], tiny.config.vocab_size)
    )
    both = _generate(tiny, prompts, settings, FORCED_3, pruning=flat, **engine)
    assert both[0].metrics["drafted_tokens"] > 0 and both[0].metrics["passes_per_token"] < 1
    for a, b in zip(flat_only, both, strict=True):
        assert b.token_ids == a.token_ids
        np.testing.assert_array_equal(b.kept_blocks, a.kept_blocks)
        np.testing.assert_allclose(b.entropy, a.entropy, rtol=1e-4, atol=1e-5)
    assert sum(both[0].kept_blocks) < 0.5 * sum(dense[0].kept_blocks)

    both = _generate(tiny, prompts, settings, FORCED_3, pruning=pruned, **engine)
    assert both[1].token_ids == pruned_only[1].token_ids
    np.testing.assert_array_equal(both[1].kept_blocks, pruned_only[1].kept_blocks)
    assert both[0].metrics["drafted_tokens"] > 0 and both[1].metrics["drafted_tokens"] == 0


def test_prompt_lookup_by_hand():
    ctx = np.array([5, 6, 7, 8, 9, 5, 6, 7], np.int32)
    assert lookup_draft(ctx, 3, 3, 1) == [8, 9, 5]  # "5 6 7" seen before: what followed
    assert lookup_draft(ctx, 10, 3, 1) == [8, 9, 5, 6, 7]  # cut where the context ends
    later = np.array([1, 2, 9, 1, 2, 3, 4, 1, 2], np.int32)
    assert lookup_draft(later, 2, 2, 1) == [3, 4]  # the latest earlier match wins
    # ... among those followed by a whole draft: the latest "4 1" has 3 tokens after it, not 4.
    near = np.array([4, 1, 7, 8, 9, 4, 1, 2, 4, 1], np.int32)
    assert lookup_draft(near, 3, 2, 1) == [2, 4, 1]
    assert lookup_draft(near, 4, 2, 1) == [7, 8, 9, 4]
    assert lookup_draft(near, 9, 2, 1) == [2, 4, 1]  # none has 9 after it: the latest
    assert lookup_draft(np.array([1, 2, 3], np.int32), 4, 3, 1) == []  # no repeat
    assert lookup_draft(np.array([4, 1, 4], np.int32), 2, 3, 2) == []  # tails shorter than 2
    assert lookup_draft(ctx, 0, 3, 1) == []
    # A list copied: items 10 11, 20 21, 30 31 after separators 5 6; the copy has reached
    # "5 6" after its first item. The latest "5 6" (ngram_max 2) is the copy's own, which
    # proposes the item just copied; the longest tail, "10 11 5 6", is found in the list.
    copy = np.array([5, 6, 10, 11, 5, 6, 20, 21, 5, 6, 30, 31, 9, 5, 6, 10, 11, 5, 6], np.int32)
    assert lookup_draft(copy, 2, 2, 1) == [10, 11]
    assert lookup_draft(copy, 2, 16, 1) == [20, 21]
    assert lookup_draft(copy, 2, 16, 6) == [20, 21]  # the longest: "5 6 10 11 5 6"
    assert lookup_draft(copy, 2, 16, 7) == []  # no tail of 7 recurs


def test_matched_tail_by_hand():
    ctx = np.array([5, 6, 7, 8, 9, 5, 6, 7], np.int32)
    assert matched_tail(ctx, 16) == 3  # "5 6 7" recurs, "9 5 6 7" does not
    assert matched_tail(ctx, 2) == 2
    assert matched_tail(np.array([1, 2, 3], np.int32), 16) == 0  # the last token is new
    assert matched_tail(np.array([7], np.int32), 16) == 0
    # The list copied in test_prompt_lookup_by_hand: "5 6 10 11 5 6" recurs, 6 tokens.
    copy = np.array([5, 6, 10, 11, 5, 6, 20, 21, 5, 6, 30, 31, 9, 5, 6, 10, 11, 5, 6], np.int32)
    assert matched_tail(copy, 16) == 6


def test_a_copy_under_way_drafts_after_an_uncertain_token_on_its_own_estimate():
    # Measured at batch 1: a burst step 10 ms; verifying 2, 4 and 8 slots 14, 18, 27 ms.
    costs = StepCosts(burst={1: 0.010}, verify={(1, 2): 0.014, (1, 4): 0.018, (1, 8): 0.027})
    cfg = SpeculationConfig(enabled=True, acceptance_memory=0.7, min_survival=0.25)
    # A row whose drafts failed where the model left the text (0.2 < 0.25: it drafts
    # nothing), after an uncertain token (3.0 > entropy_max 1.5).
    row = DraftHistory(0.2)
    assert draft_lengths([3.0], [row], cfg, 100, costs=costs, tails=[7]) == [0]
    # A tail of 8 (COPY_TAIL) is a copy: it drafts by the copy estimate, 0.9. The gate, per
    # burst step of cost: 1 draft (1 + 0.9) / 1.4 = 1.36 tokens; 3, (1 + 0.9 + 0.81 +
    # 0.729) / 1.8 = 1.91; 7, (1 + 9 * (1 - 0.9 ** 7)) / 2.7 = 5.695 / 2.7 = 2.11: 7.
    assert COPY_ACCEPTANCE == 0.9
    assert draft_lengths([3.0], [row], cfg, 100, costs=costs, tails=[8]) == [7]
    # Its verdict (3 of the 4 positions checked) moves the copy estimate, not the other,
    # nor the pool that new rows start from.
    pool = DraftHistory(0.72)
    record_verification([row], [7], [3], [True], pool, cfg)
    assert row.copying == pytest.approx(0.7 * 0.9 + 0.3 * 3 / 4)
    assert row.acceptance == 0.2
    assert (pool.acceptance, pool.drafted) == (0.72, 0)
    assert (row.drafted, row.accepted, row.verify_steps) == (7, 3, 1)
    # The next round's tail is short and its token sure: the other estimate decides (0.2:
    # nothing) and rests towards the pool.
    assert draft_lengths([0.1], [row], cfg, 100, pool, costs=costs, tails=[2]) == [0]
    assert row.acceptance == pytest.approx(0.7 * 0.2 + 0.3 * 0.72)
    # A copy estimate that fell below min_survival, within a copy (the last round's tail was
    # long too), rests towards COPY_ACCEPTANCE.
    row.copying, row.copy = 0.2, True
    assert draft_lengths([0.1], [row], cfg, 100, costs=costs, tails=[16]) == [0]
    assert row.copying == pytest.approx(0.7 * 0.2 + 0.3 * 0.9)
    # With ngram_max 4, a tail of 4 is as long as the lookup looks: a copy.
    short = dataclasses.replace(cfg, ngram_max=4, ngram_min=1)
    assert draft_lengths([3.0], [DraftHistory(0.2)], short, 100, costs=costs, tails=[4]) == [7]
    # Two rows, a budget of 4 drafts: the copy is served before a surer row without one.
    rows = [DraftHistory(0.9), DraftHistory(0.9)]
    eager = dataclasses.replace(cfg, max_draft=4, draft_budget=6, **EAGER)
    assert draft_lengths([0.1, 2.0], rows, eager, 100, tails=[1, 12]) == [0, 4]


def test_a_new_copy_starts_at_the_copy_prior_and_a_one_token_tail_drafts_by_its_evidence():
    costs = StepCosts(burst={1: 0.010}, verify={(1, 2): 0.016, (1, 4): 0.018, (1, 8): 0.027})
    cfg = SpeculationConfig(enabled=True, acceptance_memory=0.7, min_survival=0.25)
    # The model left a copy: its drafts failed (copy estimate 0.2), then a round's tail was
    # short. When a tail of 8 recurs, a new copy starts from COPY_ACCEPTANCE (0.9), and
    # drafts 7 (2.11 tokens per burst step of cost, the test above).
    row = DraftHistory(0.2, copying=0.2)
    assert draft_lengths([0.1], [row], cfg, 100, costs=costs, tails=[2]) == [0]
    assert draft_lengths([3.0], [row], cfg, 100, costs=costs, tails=[9]) == [7]
    assert row.copying == COPY_ACCEPTANCE
    # A sure row whose own estimate is 0.9, after a lookup that matched one token: it drafts
    # by at most ONE_TOKEN_TAIL_ACCEPTANCE (0.45): k = 1 (0.45 ** 2 < 0.25), which commits
    # (1 + 0.45) / 1.6 = 0.91 tokens per burst step of cost, below a burst's 1: turned down,
    # and the row rests (towards the prior 0.72) from its own 0.9, not from the cap.
    assert ONE_TOKEN_TAIL_ACCEPTANCE == 0.45
    sure = DraftHistory(0.9)
    assert draft_lengths([0.1], [sure], cfg, 100, costs=costs, tails=[1]) == [0]
    assert sure.acceptance == pytest.approx(0.7 * 0.9 + 0.3 * cfg.acceptance_prior)
    # Where verifying 2 slots costs 1.1 burst steps (an accelerator's step is bound by
    # reading the weights): (1 + 0.45) / 1.1 = 1.32 > 1, one draft.
    cheap = StepCosts(burst={1: 0.010}, verify={(1, 2): 0.011, (1, 4): 0.012, (1, 8): 0.014})
    sure = DraftHistory(0.9)
    assert draft_lengths([0.1], [sure], cfg, 100, costs=cheap, tails=[1]) == [1]
    # Its verdict moves its own estimate (0.9), not the cap: one of one accepted.
    record_verification([sure], [1], [1], [True], DraftHistory(0.72), cfg)
    assert sure.acceptance == pytest.approx(0.7 * 0.9 + 0.3 * 1.0)
    # A longer tail lifts the cap: 0.9 ** 13 >= 0.25, 7 drafts (max_draft).
    assert draft_lengths([0.1], [sure], cfg, 100, costs=cheap, tails=[2]) == [7]


def test_token_history_grows_with_the_output():
    history = TokenHistory()
    prompt = list(range(300))
    assert history.view(prompt, []).tolist() == prompt
    out = [7, 8]
    assert history.view(prompt, out).tolist() == prompt + out
    out += list(range(500))
    assert history.view(prompt, out).tolist() == prompt + out


def test_draft_lengths_follow_entropy_acceptance_and_budget():
    cfg = SpeculationConfig(
        enabled=True,
        max_draft=4,
        entropy_max=1.5,
        min_survival=0.25,
        draft_budget=8,
        acceptance_prior=0.5,
        **EAGER,
    )
    # a = 0.5: 0.5**2 = 0.25 >= 0.25, 0.5**3 < 0.25 -> 2; a = 0.8: 0.8**6 = 0.26 -> capped at 4.
    assert wanted_length(0.3, DraftHistory(0.5), cfg) == 2
    assert wanted_length(0.3, DraftHistory(0.8), cfg) == 4
    assert wanted_length(2.0, DraftHistory(0.8), cfg) == 0  # unsure: no draft
    assert wanted_length(None, DraftHistory(0.8), cfg) == 0  # nothing sampled yet
    shy = DraftHistory(0.2)  # 0.2 < 0.25: no draft, and the estimate relaxes to the prior
    assert wanted_length(0.1, shy, cfg) == 0
    assert shy.acceptance == pytest.approx(0.7 * 0.2 + 0.3 * 0.5)
    # Lowest entropy first, 8 tokens a step: 3 rows leave 5 drafts, 4 to the surest, then 1.
    histories = [DraftHistory(0.8) for _ in range(3)]
    assert draft_lengths([0.9, 0.1, 3.0], histories, cfg, budget=100) == [1, 4, 0]
    assert draft_lengths([0.9, 0.1, 3.0], histories, cfg, budget=2) == [0, 2, 0]
    assert draft_lengths([0.1] * 8, [DraftHistory(0.8)] * 8, cfg, budget=100) == [0] * 8
    # 1 of 4 drafts accepted: the second was rejected, the last two never tried; the
    # positions checked accepted 1 of 2.
    record = DraftHistory(0.5)
    record.record(4, 1, cfg)
    assert record.acceptance == pytest.approx(0.7 * 0.5 + 0.3 * 0.5)
    assert (record.drafted, record.accepted, record.verify_steps) == (4, 1, 1)
    record.record(3, 3, cfg)  # all accepted: 3 of 3
    assert record.acceptance == pytest.approx(0.7 * 0.5 + 0.3)


def test_the_engine_pools_the_steps_lookup_drafts_for_new_sequences():
    cfg = SpeculationConfig(enabled=True, acceptance_prior=0.72, acceptance_memory=0.7)
    pool = DraftHistory(cfg.acceptance_prior)
    rows = [DraftHistory(0.72), DraftHistory(0.5), DraftHistory(0.9)]
    # Two lookup rows (3 drafted, 1 accepted: 1 of the 2 positions checked; 2 drafted, 0
    # accepted: 0 of 1) and a constrained row's forced run (4 of 4), which the pool leaves
    # out: it takes 1 of 3 positions as one verification. The forced row's own estimate
    # stays (its lookups may differ), its totals count the run.
    record_verification(rows, [3, 2, 4], [1, 0, 4], [True, True, False], pool, cfg)
    assert [h.acceptance for h in rows] == pytest.approx([0.7 * 0.72 + 0.3 / 2, 0.7 * 0.5, 0.9])
    assert (rows[2].drafted, rows[2].accepted, rows[2].verify_steps) == (4, 4, 1)
    assert pool.acceptance == pytest.approx(0.7 * 0.72 + 0.3 / 3)
    assert (pool.drafted, pool.accepted, pool.verify_steps) == (5, 1, 1)
    # A step whose only drafts were forced leaves the pool as it was.
    record_verification(rows[2:], [2], [2], [False], pool, cfg)
    assert pool.acceptance == pytest.approx(0.7 * 0.72 + 0.3 / 3)
    # After two more such steps a new sequence would start at 0.47 and draft one token where
    # the prior gives it 4 (0.47 ** 2 < 0.25 = min_survival <= 0.72 ** 4).
    for _ in range(2):
        record_verification(rows[:2], [3, 2], [1, 0], [True, True], pool, cfg)
    assert wanted_length(0.1, DraftHistory(pool.acceptance), cfg) == 1
    assert wanted_length(0.1, DraftHistory(cfg.acceptance_prior), cfg) == 4


def test_resting_rows_relax_towards_the_pool_and_the_pool_slowly_towards_the_prior():
    cfg = SpeculationConfig(
        enabled=True, acceptance_prior=0.72, acceptance_memory=0.7, min_survival=0.25
    )
    pool = DraftHistory(0.1)  # the engine's drafts have failed
    row = DraftHistory(0.2)  # 0.2 < 0.25: draft nothing, rest
    assert draft_lengths([0.1], [row], cfg, budget=100, pool=pool) == [0]
    assert row.acceptance == pytest.approx(0.7 * 0.2 + 0.3 * 0.1)  # towards the pool
    assert pool.acceptance == pytest.approx(0.95 * 0.1 + 0.05 * 0.72)  # POOL_REST_MEMORY
    # Unsure rows do not rest anything.
    before = (row.acceptance, pool.acceptance)
    assert draft_lengths([3.0], [row], cfg, budget=100, pool=pool) == [0]
    assert (row.acceptance, pool.acceptance) == before
    # Rounds of sure rows drafting nothing, from a row at 0.2 and the pool at 0.1 (a pass's
    # fixed cost as an accelerator's, so the cost gate lets any draft through): by hand,
    # r' = 0.7 r + 0.3 p then p' = 0.95 p + 0.05 * 0.72 reaches r >= 0.25 in round 10
    # (r = 0.260, p = 0.329); a row resting towards the prior, in round 2 (0.356).
    cfg = dataclasses.replace(cfg, **EAGER)
    row, pool = DraftHistory(0.2), DraftHistory(0.1)
    rounds = 1
    while draft_lengths([0.1], [row], cfg, budget=100, pool=pool) == [0]:
        rounds += 1
    assert rounds == 10
    row, rounds = DraftHistory(0.2), 1
    while draft_lengths([0.1], [row], cfg, budget=100) == [0]:
        rounds += 1
    assert rounds == 2


def test_verification_is_turned_down_where_a_burst_step_makes_tokens_cheaper():
    # The CPU's costs: a pass of n padded tokens costs 5 + n, verifying 0.5 more per padded
    # row; a verifying step alone pads a lone row's token and drafts to 2, 4 or 8. One row,
    # 4 drafts at a = 0.8: E = 0.8 + 0.64 + 0.512 + 0.4096 = 2.3616 accepted; verifying:
    # (5 + 8 + 0.5) / 3.3616 = 4.02 per token, a burst step (5 + 1) / 1 = 6: pays.
    cfg = SpeculationConfig(enabled=True, max_draft=4, pass_fixed_tokens=5.0, verify_row_tokens=0.5)
    assert expected_accepted(4, 0.8) == pytest.approx(2.3616)
    assert verification_pays([4], [0.8], cfg)
    # But 3 drafts fill 4 slots: (5 + 4 + 0.5) / 2.952 = 3.22 per token, cheaper still (1
    # draft: 7.5 / 1.8 = 4.17), so the row that wants 4 (0.8 ** 4 >= 0.25) drafts 3.
    assert draft_lengths([0.1], [DraftHistory(0.8)], cfg, budget=100) == [3]
    # One drafted token at a = 0.2: (5 + 2 + 0.5) / 1.2 = 6.25 > 6: a burst step is cheaper.
    assert not verification_pays([1], [0.2], cfg)
    # Fifteen rows, one drafts a token at a = 0.9 (the full loop's drained batch): verifying
    # (5 + 16 + 0.5 * 16) / 15.9 = 1.82 per token against (5 + 16) / 15 = 1.40: turned down,
    # and the confident row's estimate relaxes towards the prior (0.72).
    histories = [DraftHistory(0.9)] + [DraftHistory(0.9) for _ in range(14)]
    entropies = [0.1] + [3.0] * 14
    assert draft_lengths(entropies, histories, cfg, budget=100) == [0] * 15
    assert histories[0].acceptance == pytest.approx(0.7 * 0.9 + 0.3 * 0.72)
    assert histories[1].acceptance == 0.9  # was not confident: untouched
    # The same row with a fixed cost of 1000 (an accelerator reading its weights) verifies.
    eager = dataclasses.replace(cfg, **EAGER)
    assert draft_lengths(entropies, [DraftHistory(0.9)] * 15, eager, budget=100)[0] == 1
    assert not verification_pays([0, 0], [0.9, 0.9], eager)  # nothing drafted: nothing to gain


def test_a_lone_row_drafts_what_fills_the_bucket_that_pays_best_on_measured_costs():
    # Measured at batch 1: a burst step 10 ms; verifying 2, 4 and 8 slots 14, 18 and 27 ms
    # (1.4x, 1.8x, 2.7x). Per burst step of cost, a row accepting a = 0.6 commits with 1
    # draft 1.6 / 1.4 = 1.14 tokens; with 3, (1 + 0.6 + 0.36 + 0.216) / 1.8 = 1.21. It
    # wants 2 (0.6 ** 2 >= 0.25 > 0.6 ** 3), which pad to 4 slots anyway, so it drafts 3.
    costs = StepCosts(burst={1: 0.010}, verify={(1, 2): 0.014, (1, 4): 0.018, (1, 8): 0.027})
    cfg = SpeculationConfig(enabled=True)
    assert wanted_length(0.1, DraftHistory(0.6), cfg) == 2
    assert draft_lengths([0.1], [DraftHistory(0.6)], cfg, 100, costs=costs) == [3]
    # At a = 0.95: 3 drafts commit 3.71 / 1.8 = 2.06, 7 commit (1 + 5.73) / 2.7 = 2.49.
    assert draft_lengths([0.1], [DraftHistory(0.95)], cfg, 100, costs=costs) == [7]
    # At a = 0.3 (wants 1): 1.3 / 1.4 = 0.93 < 1, a burst step commits more.
    assert draft_lengths([0.1], [DraftHistory(0.3)], cfg, 100, costs=costs) == [0]
    # Within a budget of 2 drafts, 2 in 4 slots commit (1 + 0.96) / 1.8 = 1.09: 1 does better.
    assert draft_lengths([0.1], [DraftHistory(0.6)], cfg, 2, costs=costs) == [1]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_draft=0), "max_draft=0"),
        (dict(max_draft=16), "max_draft=16"),
        (dict(ngram_min=3, ngram_max=2), "ngram_min=3"),
        (dict(entropy_max=0.0), "entropy_max"),
        (dict(acceptance_prior=1.0), "acceptance_prior"),
        (dict(min_survival=0.0), "min_survival"),
        (dict(enabled="yes"), "enabled"),
    ],
)
def test_bad_speculation_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SpeculationConfig(**kwargs)


def test_speculation_conflicts_are_named(tmp_path):
    with pytest.raises(ValueError, match="steps_per_sync >= 8"):
        RuntimeOptions(speculation=SPEC, steps_per_sync=7)
    path = tmp_path / "short.toml"
    path.write_text("[engine]\nsteps_per_sync = 4\n[speculation]\nenabled = true\n")
    with pytest.raises(ConfigError, match=r"short\.toml.*steps_per_sync >= 8"):
        load_run_config(path)
    path.write_text("[speculation]\nmax_drafts = 3\n")
    with pytest.raises(ConfigError, match=r"\[speculation\] unknown key 'max_drafts'"):
        load_run_config(path)


# etjax against etjax, on the programs test_greedy_with_speculation_equals_greedy_without
# compiled cheaply (as users compile, it compiled two of them again: 16 s).
@pytest.mark.compile_bound
def test_decode_takes_speculation_and_names_bad_values(smollm2, lee, plain_greedy):
    import etjax
    from etjax.errors import RequestError

    # The prompts (and engine sizes) of the tests above: the programs they compiled; the
    # truth is the plain engine's greedy outputs. Drafting as there (SPEC): on this CPU the
    # default cost gate, timed, may verify nothing, or compile other verifying steps.
    prompts, plain = plain_greedy
    texts = _repetitive_texts(lee)
    spec = etjax.decode(
        texts, model=smollm2, max_new_tokens=GREEDY_NEW, temperature=0, speculation=SPEC
    )
    assert [r.prompt_token_ids for r in spec] == prompts
    assert [r.token_ids for r in spec] == [o.token_ids for o in plain]
    assert spec[0].accepted_tokens > 0 and spec[0].model_passes < GREEDY_NEW  # drafts verified
    with pytest.raises(RequestError, match="speculation='yes'"):
        etjax.decode("x", model=smollm2, speculation="yes")
    with pytest.raises(RequestError, match="max_draft=9 needs steps_per_sync >= 10"):
        etjax.decode("x", model=smollm2, speculation=SpeculationConfig(enabled=True, max_draft=9))
