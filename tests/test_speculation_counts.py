"""What speculation did, counted per request, and the cost gate on measured step costs.

The truth is worked out by hand: on the mock device (tests/engine_mock.py) a request's tokens
are known in advance, so a prompt that holds them makes every lookup draft right, and the
rounds, drafts and passes follow from the rule's constants; on the tiny model, drafts taken
from the plain run's own greedy output must all be accepted. The gate's measured costs are a
table the test sets (never a real timing).
"""

from __future__ import annotations

import logging

import jax
import numpy as np
import pytest

from etjax.drafting import SpeculationConfig, StepCosts, compile_events
from etjax.drafting.costs import STALE_BURSTS
from etjax.drafting.rule import expected_positions, step_cost_ratio, verification_pays
from etjax.engine.engine import Engine
from etjax.engine.policies import make_policy
from etjax.runtime.options import TRACE_FIELDS, RequestSettings, RuntimeOptions
from etjax.runtime.state import StepOutputs
from tests.engine_mock import MockBackend, token_of

PAGE, K = 4, 4  # steps_per_sync 4: room for 3 drafts


class DraftingMock(MockBackend):
    """The mock, verifying drafts: a row's drafts are accepted while each is the token the
    mock would sample there (`token_of`), and the row commits its own token and those."""

    def mixed(self, rows, pages, lengths, budgets, jobs, drafts=None):
        if not drafts or not any(drafts):
            return super().mixed(rows, pages, lengths, budgets, jobs, drafts)
        assert not jobs, "these tests prefill before they draft"
        width, n = 1 + max(map(len, drafts)), len(rows)
        names = ("tokens", "emitted", "finish", *TRACE_FIELDS.values())
        merged = {name: [] for name in names}
        for row, row_pages, length, draft in zip(rows, pages, lengths, drafts, strict=True):
            state = self.rows[row]
            right = [token_of(state.request_id, state.generated + 1 + i) for i in range(len(draft))]
            wrong = [i for i, (d, t) in enumerate(zip(draft, right, strict=True)) if d != t]
            taken = wrong[0] if wrong else len(draft)
            out, _ = self._decode([row], [row_pages], [length], 1 + taken)
            for name in names:
                column = np.asarray(getattr(out, name))[:, 0]
                padded = np.zeros(width, column.dtype)
                padded[: len(column)] = column
                merged[name].append(padded)
        out = StepOutputs(**{name: np.stack(merged[name], axis=1) for name in names})
        return out, np.ones(n, np.float32), [], []


def _copying_engine(costs: StepCosts | None, **spec) -> tuple[Engine, list[int]]:
    # One request (id 1, sure: entropy 0.5 at every token) whose prompt holds the 12 tokens
    # it will generate, after its id and a 5: prompt lookup drafts exactly them.
    options = RuntimeOptions(
        page_size=PAGE,
        max_batch_size=1,
        steps_per_sync=K,
        prefill_chunk=8,
        speculation=SpeculationConfig(**({"enabled": True, "max_draft": 3} | spec)),
    )
    backend = DraftingMock(256, K, PAGE, entropy={1: (0.5, 0.0)})
    policy = make_policy("fcfs", 1000.0, 1.0, 1, PAGE)
    engine = Engine(backend, None, options, policy, step_costs=costs)
    return engine, [1, 5, *(token_of(1, i) for i in range(12))]


def _counts(metrics: dict) -> tuple[float, ...]:
    return tuple(
        metrics[k] for k in ("model_passes", "drafted_tokens", "accepted_tokens", "verify_steps")
    )


def test_counts_of_a_copying_request_by_hand():
    # Prefill (14 tokens in chunks of 8) takes two rounds; then, by hand:
    # - no token yet, so no entropy: a burst of K = 4 steps, T0..T3 (4 passes);
    # - acceptance 0.72 (the prior): 0.72 ** 4 >= 0.25, max_draft 3 drafts T5..T7 after the
    #   row's own T4; the cost model prices the verifying step (4 tokens) at (5 + 4 + 0.5) /
    #   (5 + 1) = 1.58 burst steps against 1 + 0.72 + 0.72**2 + 0.72**3 = 2.61 tokens (1 draft:
    #   1.25 against 1.72, fewer per step of cost): it verifies 3, all accepted (1 pass, 4
    #   tokens);
    # - T0..T7 recur in the prompt: a tail of 8, a copy round (rule.py, `COPY_TAIL`) at the
    #   copy estimate 0.9: 3 drafts again, all accepted: T8..T11, done.
    # 12 tokens = 6 passes + 6 accepted drafts, in 2 verifying passes.
    engine, prompt = _copying_engine(None)
    (out,) = engine.generate([prompt], [RequestSettings(12)])
    assert out.token_ids == [token_of(1, i) for i in range(12)]
    assert _counts(out.metrics) == (6.0, 6.0, 6.0, 2.0)
    assert out.metrics["passes_per_token"] == 0.5 and out.metrics["acceptance_rate"] == 1.0


def test_a_measured_verifying_step_too_dear_turns_the_drafts_down():
    # The same request on a machine where a verifying step of 4 tokens costs 3.5 burst steps
    # (measured): 3 drafts at 0.72 make 2.61 tokens, and at the copy estimate 0.9 (from the
    # third round the tail T0..T7 is a copy's: rule.py, `COPY_TAIL`) 3.44 < 3.5; 1 draft in 2
    # tokens (priced by the model's ratio, 3.5 * 7.5 / 9.5 = 2.76) 1.72 or 1.9: every round
    # bursts (12 passes, no drafts). Where it costs 2 (1 + 1.61 > 2), the rounds verify as
    # with the cost model.
    dear = StepCosts(burst={1: 0.010}, verify={(1, 4): 0.035}, frozen=True)
    engine, prompt = _copying_engine(dear)
    (out,) = engine.generate([prompt], [RequestSettings(12)])
    assert out.token_ids == [token_of(1, i) for i in range(12)]
    assert _counts(out.metrics) == (12.0, 0.0, 0.0, 0.0)
    cheap = StepCosts(burst={1: 0.010}, verify={(1, 4): 0.020}, frozen=True)
    engine, prompt = _copying_engine(cheap)
    (out,) = engine.generate([prompt], [RequestSettings(12)])
    assert _counts(out.metrics) == (6.0, 6.0, 6.0, 2.0)
    # measured_costs off: the cost model decides (1.58 < 2.61), whatever was measured.
    engine, prompt = _copying_engine(dear, measured_costs=False)
    (out,) = engine.generate([prompt], [RequestSettings(12)])
    assert _counts(out.metrics) == (6.0, 6.0, 6.0, 2.0)


def test_the_engine_records_whole_bursts_and_verifying_steps():
    # The copying run above: one whole burst (T0..T3) and two verifying steps of 1 row and
    # 3 drafts (token bucket 4: a verifying step alone pads to 2, 4, 8, ...). The mock
    # compiles nothing, so every call is a sample.
    costs = StepCosts()
    engine, prompt = _copying_engine(costs)
    engine.generate([prompt], [RequestSettings(12)])
    assert costs.samples() == {"burst rows=1": 1, "verify rows=1 tokens=4": 2}
    # A burst cut short (2 tokens left: the scan's last steps run no row) is no sample.
    engine, prompt = _copying_engine(costs, enabled=False)
    engine.generate([prompt], [RequestSettings(6)])
    assert costs.samples()["burst rows=1"] == 2


def test_step_costs_read_medians_and_scale_unmeasured_shapes_by_the_model():
    cfg = SpeculationConfig(enabled=True)  # pass_fixed_tokens 5, verify_row_tokens 0.5
    costs = StepCosts()
    costs.record_burst(1, 0.040)
    assert costs.burst_seconds(1) is None  # one sample is not enough (MIN_SAMPLES = 2)
    for seconds in (0.050, 0.044):
        costs.record_burst(1, seconds)
    assert costs.burst_seconds(1) == pytest.approx(0.044)  # median of 40, 50, 44 ms
    for seconds in (0.090, 0.500, 0.092):  # one slow call moves nothing
        costs.record_verify(1, 7, 1, seconds)  # one drafted position checked
    assert costs.verify_seconds(1, 4, None, 1) == pytest.approx(0.092)  # same bucket: 8 tokens
    ratio, source = step_cost_ratio(1, 7, cfg, costs, 1.0)
    assert ratio == pytest.approx(0.092 / 0.044) and source.startswith("measured")
    # 1 row and 12 drafts: 16 tokens, not measured; from the 8-token step by the model's
    # ratio, (5 + 16 + 0.5) / (5 + 8 + 0.5); 3 drafts, 4 tokens: (5 + 4 + 0.5) / 13.5.
    ratio, _ = step_cost_ratio(1, 12, cfg, costs, 1.0)
    assert ratio == pytest.approx(0.092 * 21.5 / 13.5 / 0.044)
    ratio, _ = step_cost_ratio(1, 3, cfg, costs, 1.0)
    assert ratio == pytest.approx(0.092 * 9.5 / 13.5 / 0.044)
    # Steps that checked all 7 positions: 158 and 160 ms. At 2.5 positions, a quarter of the
    # way from 1 to 7: 92 + 0.25 * (159 - 92) = 108.75 ms; past 7 (or below 1), the nearest.
    costs.record_verify(1, 7, 7, 0.158)
    costs.record_verify(1, 7, 7, 0.160)
    assert costs.verify_seconds(1, 7, None, 2.5) == pytest.approx(0.10875)
    assert costs.verify_seconds(1, 7, None, 9.0) == pytest.approx(0.159)
    assert costs.verify_seconds(1, 7, None, 0.0) == pytest.approx(0.092)
    assert costs.medians()["verify rows=1 tokens=8 checked=7"] == pytest.approx(0.159)
    # 2 rows: nothing measured at that bucket, so the model: (5 + 8 + 0.5 * 2) / (5 + 2).
    ratio, source = step_cost_ratio(2, 3, cfg, costs)
    assert ratio == pytest.approx(14 / 7) and source.startswith("cost model")
    frozen = StepCosts(burst={1: 1.0}, frozen=True)
    frozen.record_burst(1, 9.0)
    assert frozen.burst_seconds(1) == 1.0


def test_the_gate_prices_the_positions_it_expects_to_check():
    # Measured at batch 1: a burst step 40 ms; a verifying step 80 ms when one position was
    # checked, 160 ms when all 7 were. 4 drafts at 0.72 check 1 + 0.72 + 0.72**2 + 0.72**3
    # = 2.61 positions: 80 + 1.61 / 6 * 80 = 101.5 ms, 2.54x, below 1 + 1.88 = 2.88: verify.
    # Priced at the 7-position step (4.0x) it would not.
    cfg = SpeculationConfig(enabled=True)
    costs = StepCosts(burst={1: 0.040})
    for checked, seconds in ((1, 0.080), (1, 0.080), (7, 0.160), (7, 0.160)):
        costs.record_verify(1, 7, checked, seconds)
    assert expected_positions(4, 0.72) == pytest.approx(2.611648)
    ratio, _ = step_cost_ratio(1, 4, cfg, costs, expected_positions(4, 0.72))
    assert ratio == pytest.approx((0.080 + 1.611648 / 6 * 0.080) / 0.040)
    assert verification_pays([4], [0.72], cfg, costs)
    assert not verification_pays([4], [0.72], cfg, StepCosts({1: 0.04}, {(1, 8): 0.16}))


def test_a_count_of_positions_seen_once_is_not_read_alone():
    # Three steps, each checking a different count (1, 3, 7 positions), one of them slow:
    # no count has 2 samples, so every count reads the median of all three (90 ms), not
    # the slow call's 400 ms at 3 positions. A second step at 7 makes that count's median
    # (90 and 94: 92 ms) the figure for every count.
    costs = StepCosts()
    for checked, seconds in ((1, 0.080), (3, 0.400), (7, 0.090)):
        costs.record_verify(1, 7, checked, seconds)
    assert [costs.verify_seconds(1, 7, None, c) for c in (1, 3, 7)] == pytest.approx([0.090] * 3)
    costs.record_verify(1, 7, 7, 0.094)
    assert [costs.verify_seconds(1, 7, None, c) for c in (1, 3, 7)] == pytest.approx([0.092] * 3)


def test_verifying_figures_not_refreshed_for_stale_bursts_are_forgotten():
    # Two verifying steps timed under load (400 ms against 40 ms bursts: the gate stays
    # shut, so no verifying step refreshes them): after STALE_BURSTS bursts of the same row
    # bucket without one they are dropped and the cost model decides again; a verifying
    # step in between restarts the count; another row bucket's bursts do not count.
    costs = StepCosts()
    for _ in range(2):
        costs.record_verify(1, 7, 1, 0.400)
    for _ in range(STALE_BURSTS - 1):
        costs.record_burst(1, 0.040)
        costs.record_burst(4, 0.060)
    assert costs.verify_seconds(1, 7, None, 1) == pytest.approx(0.400)
    costs.record_verify(1, 7, 1, 0.400)  # measured again: the count restarts
    for _ in range(STALE_BURSTS - 1):
        costs.record_burst(1, 0.040)
    assert costs.verify_seconds(1, 7, None, 1) == pytest.approx(0.400)
    costs.record_burst(1, 0.040)
    assert costs.verify_seconds(1, 7, None, 1) is None
    assert costs.burst_seconds(1) == pytest.approx(0.040)


def test_the_gate_on_measured_costs_both_ways_and_its_debug_line(caplog):
    cfg = SpeculationConfig(enabled=True, max_draft=3)
    # 3 drafts at 0.72: 1 + 2.61 tokens per verifying step against 1 per burst step.
    cheap = StepCosts(burst={1: 0.04}, verify={(1, 4): 0.10}, frozen=True)  # 2.5x
    dear = StepCosts(burst={1: 0.04}, verify={(1, 4): 0.15}, frozen=True)  # 3.75x
    with caplog.at_level(logging.DEBUG, logger="etjax"):
        assert verification_pays([3], [0.72], cfg, cheap)
        assert not verification_pays([3], [0.72], cfg, dear)
    lines = [r.getMessage() for r in caplog.records if "speculation gate" in r.getMessage()]
    assert len(lines) == 2
    assert "2.50x" in lines[0] and "measured" in lines[0] and lines[0].endswith("verify")
    assert "3.75x" in lines[1] and "below 2.61x" in lines[1] and lines[1].endswith("burst")


def test_a_call_that_compiles_moves_the_compile_count():
    before = compile_events()
    jax.jit(lambda x: x * 3 + 1)(np.ones(5, np.float32)).block_until_ready()
    assert compile_events() > before
    after = compile_events()
    jax.jit(lambda x: x)  # no call, nothing compiled
    assert compile_events() == after


def test_drafts_of_the_plain_greedy_output_are_all_accepted_and_counted(tiny_hf_dir, monkeypatch):
    # On the tiny model through decode(): the drafts are the plain greedy run's next tokens
    # (a lookup that always finds the passage it repeats), so verification accepts every one.
    # By hand, 24 tokens: T0 is drawn with the prompt and held pending; the first round
    # runs it with 7 drafts after it (acceptance 0.9: max_draft = 7), T1..T7; then 7 drafts
    # after the row's own token, twice (T8..T15, T16..T23): 3 passes, 21 drafted, 21
    # accepted, 3 verifying passes.
    import etjax
    import etjax.engine.engine as engine_module

    tiny = etjax.load_model(tiny_hf_dir("llama"))
    text = "Repeat the passage above word for word."
    (plain,) = etjax.decode(text, model=tiny, max_new_tokens=24, ignore_eos=True)
    assert (plain.model_passes, plain.drafted_tokens, plain.verify_steps) == (24, 0, 0)
    prompt, output = plain.prompt_token_ids, plain.token_ids

    def lookup(context, length, ngram_max, ngram_min):
        assert context[: len(prompt)].tolist() == prompt
        done = len(context) - len(prompt)
        return output[done : done + length]

    monkeypatch.setattr(engine_module, "lookup_draft", lookup)
    spec = SpeculationConfig(
        enabled=True,
        entropy_max=100.0,  # a random model is never sure
        acceptance_prior=0.9,
        pass_fixed_tokens=1000.0,
        measured_costs=False,
    )
    (fast,) = etjax.decode(text, model=tiny, max_new_tokens=24, ignore_eos=True, speculation=spec)
    assert fast.token_ids == plain.token_ids
    counts = (fast.model_passes, fast.drafted_tokens, fast.accepted_tokens, fast.verify_steps)
    assert counts == (3, 21, 21, 3)


def test_bench_summary_and_table_count_what_drafting_did():
    from etjax.bench.measure import summarise
    from etjax.bench.report import absolute_table, draft_counts

    def request(tokens, passes, drafted, accepted, verifying):
        return {
            "end_to_end_latency": 1.0,
            "time_to_first_token": 0.5,
            "generated_tokens": float(tokens),
            "tau": 1.0,
            "cost_bytes": 1.0,
            "kept_fraction": 1.0,
            "decode_steps": tokens,
            "kv_bytes": 0.0,
            "preemptions": 0.0,
            "model_passes": float(passes),
            "drafted_tokens": float(drafted),
            "accepted_tokens": float(accepted),
            "verify_steps": float(verifying),
        }

    # 12 tokens in 6 passes (6 of 6 drafts accepted in 2 verifying passes) and 8 tokens
    # without drafts: 20 tokens, 14 passes, 6 drafted, 6 accepted, 2 verifying passes.
    run = {
        "throughput_tok_s": 1.0,
        "host_ms_per_step": 1.0,
        "requests": [request(12, 6, 6, 6, 2), request(8, 8, 0, 0, 0)],
    }
    s = summarise(run)
    assert (s["drafted_tokens"], s["accepted_tokens"], s["verify_steps"]) == (6, 6, 2)
    assert s["model_passes"] == 14 and s["passes_per_token"] == pytest.approx(14 / 20)
    assert s["acceptance_rate"] == 1.0 and s["mean_accepted_length"] == 3.0
    assert draft_counts(s) == "6 / 6 / 2"
    table = absolute_table({"summary": {"on": [s | {"compile_s": 0.0}]}})
    assert "| 0.70 | 6 / 6 / 2 | 0.0 |" in table
    assert "drafted / accepted / verifying passes" in table.splitlines()[0]
