"""The engine's host logic on a mock device with hand-computable outputs (tests/engine_mock.py):
ordering by policy, freedom from starvation, page accounting, preemption, cancellation and
determinism; and, on a tiny model, that drawing first tokens with their prompts changes no
output."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from etjax.engine.engine import Engine
from etjax.engine.policies import make_policy
from etjax.engine.sequence import Sequence
from etjax.errors import RequestError
from etjax.runtime.options import TRACE_FIELDS, RequestSettings, RuntimeOptions
from etjax.sampling import SamplerSettings
from tests.engine_mock import PAGE, K, MockBackend, mock_engine, token_of
from tests.hypothesis_profiles import examples

_engine = mock_engine


def _prompt(request_id: int, length: int) -> list[int]:
    return [request_id] + [5] * (length - 1)


def _generate(engine: Engine, prompts, settings, priorities=None) -> list[Sequence]:
    # As Engine.generate, but returns the host's records (timings, preemptions).
    handles = [
        engine.submit(p, s, 0.0 if priorities is None else priorities[i])
        for i, (p, s) in enumerate(zip(prompts, settings, strict=True))
    ]
    engine.run_until_idle()
    return [h.sequence for h in handles]


def _finish_order(sequences: list[Sequence]) -> list[int]:
    done = sorted(sequences, key=lambda s: (s.finish_time, s.order))
    return [s.prompt[0] for s in done]


def test_fcfs_serves_in_arrival_order_and_tokens_are_the_mock_s():
    engine, _ = _engine("fcfs", batch=1, resident=1, rounds=1)
    seqs = _generate(engine, [_prompt(r, 5) for r in (7, 8, 9)], [RequestSettings(4)] * 3)
    outs = [s.output for s in seqs]
    assert _finish_order(seqs) == [7, 8, 9]
    assert [o.token_ids for o in outs] == [[token_of(r, i) for i in range(4)] for r in (7, 8, 9)]
    assert all(o.finish_reason == "length" for o in outs)
    assert engine.pages_in_use == 0 and sorted(engine.free_rows) == [0]


def test_priority_policy_admits_the_highest_priority_first():
    engine, _ = _engine("priority", batch=1, resident=1, rounds=1)
    seqs = _generate(
        engine, [_prompt(r, 5) for r in (7, 8, 9)], [RequestSettings(4)] * 3, priorities=[0, 5, 1]
    )
    assert _finish_order(seqs) == [8, 9, 7]


@pytest.mark.parametrize("policy, first", [("entropic", 2), ("fcfs", 1)])
def test_entropic_policy_runs_the_sequence_whose_entropy_falls(policy, first):
    # Two resident sequences, one batch slot, equal lengths (equal cost per token). Request 1's
    # entropy is flat (dH+ = 0); request 2's falls 0.25 nats per token (dH+ = 0.25). The
    # entropic policy gives the slot to 2 except when 1 is overdue (every 4th round), so 2
    # finishes first; FCFS gives it to 1, the earlier arrival.
    engine, backend = _engine(
        policy, batch=1, resident=2, rounds=4, entropy={1: (3.0, 0.0), 2: (8.0, 0.25)}
    )
    seqs = _generate(engine, [_prompt(1, 8), _prompt(2, 8)], [RequestSettings(24)] * 2)
    assert _finish_order(seqs)[0] == first
    log = [ids[0] for ids in backend.decode_log]
    last_run_of_first = max(i for i, r in enumerate(log) if r == first)
    other_runs = log[: last_run_of_first + 1].count(3 - first)
    assert other_runs <= (last_run_of_first + 1) // 4 + 1  # only when overdue
    assert log.count(1) == 12 and log.count(2) == 12
    assert [s.output.token_ids for s in seqs] == [
        [token_of(r, i) for i in range(24)] for r in (1, 2)
    ]


def test_entropic_policy_steers_by_the_calibrated_entropy():
    # The raw entropies of the test above, with calibrated signals that say the opposite:
    # request 1's calibrated entropy falls, request 2's is flat. The scheduler reads the
    # calibrated signal, so 1 gets the slot and finishes first; the tokens are unchanged.
    engine, _ = _engine(
        "entropic",
        batch=1,
        resident=2,
        rounds=4,
        entropy={1: (3.0, 0.0), 2: (8.0, 0.25)},
        calibrated={1: (8.0, 0.25), 2: (3.0, 0.0)},
    )
    seqs = _generate(engine, [_prompt(1, 8), _prompt(2, 8)], [RequestSettings(24)] * 2)
    assert _finish_order(seqs)[0] == 1
    assert seqs[1].output.entropy[:3] == [8.0, 7.75, 7.5]  # the trace keeps the raw entropy
    assert seqs[1].output.calibrated_entropy[:3] == [3.0, 3.0, 3.0]
    assert [s.output.token_ids for s in seqs] == [
        [token_of(r, i) for i in range(24)] for r in (1, 2)
    ]


def test_drafting_reads_the_calibrated_entropy(monkeypatch):
    # The draft rule is handed the calibrated entropy of each row's last token, not the raw.
    import etjax.engine.engine as engine_module
    from etjax.drafting import SpeculationConfig

    seen = []

    def record(entropies, histories, cfg, budget, pool=None, costs=None, tails=None):
        seen.append(list(entropies))
        return [0] * len(entropies)  # draft nothing: the rounds stay plain bursts

    monkeypatch.setattr(engine_module, "draft_lengths", record)
    options = RuntimeOptions(
        page_size=PAGE,
        max_batch_size=1,
        steps_per_sync=K,
        speculation=SpeculationConfig(enabled=True, max_draft=1),
    )
    backend = MockBackend(256, K, PAGE, entropy={1: (5.0, 0.0)}, calibrated={1: (2.0, 0.0)})
    engine = Engine(backend, None, options, make_policy("fcfs", 1000.0, 1.0, 1, PAGE))
    engine.generate([_prompt(1, 5)], [RequestSettings(6)])
    assert [None] in seen and [2.0] in seen
    assert all(h in (None, 2.0) for step in seen for h in step)


@pytest.mark.parametrize("policy, short_resident_round", [("entropic", 0), ("fcfs", 5)])
def test_entropic_policy_prefills_the_prompt_closest_to_its_first_token_first(
    policy, short_resident_round
):
    # Three requests admitted together; chunks of 8 tokens, two rows a step. FCFS prefills
    # the two 40-token prompts first (five rounds), so the 4-token one waits for them; the
    # entropic policy gives the short prompt its chunk at once, beside the first long one.
    engine, _ = _engine(policy, batch=3, resident=3, prefill_chunk=8)
    seqs = _generate(
        engine, [_prompt(1, 40), _prompt(2, 40), _prompt(3, 4)], [RequestSettings(2)] * 3
    )
    assert seqs[2].resident_round == short_resident_round
    assert [s.output.token_ids for s in seqs] == [
        [token_of(r, i) for i in range(2)] for r in (1, 2, 3)
    ]


def test_fcfs_with_one_slot_alternates_only_when_overdue():
    # FCFS ranks by arrival: request 1 keeps the slot; 2 runs only when overdue, that is in
    # the third round after its last run (R = 3). Both prompts are prefilled before the first
    # decode round, so every round decodes K = 2 tokens: 1 needs six runs, taking rounds 0, 1,
    # 3, 4, 6, 7; 2 gets 2, 5 and 8, then runs alone for its last three.
    engine, backend = _engine("fcfs", batch=1, resident=2, rounds=3)
    outs = engine.generate([_prompt(1, 4), _prompt(2, 4)], [RequestSettings(12)] * 2)
    assert backend.decode_log == [[1], [1], [2]] * 3 + [[2]] * 3
    assert [o.token_ids for o in outs] == [[token_of(r, i) for i in range(12)] for r in (1, 2)]


def _max_gaps(log: list[list[int]]) -> dict[int, int]:
    # Largest number of decode rounds between consecutive runs of each request, counted from
    # its first run to its last.
    seen: dict[int, list[int]] = {}
    for i, ids in enumerate(log):
        for r in ids:
            seen.setdefault(r, []).append(i)
    return {r: max((b - a for a, b in itertools.pairwise(v)), default=0) for r, v in seen.items()}


@pytest.mark.parametrize("draws_first", [False, True])
def test_preemption_recomputes_and_loses_nothing(draws_first):
    # A pool too small for both sequences to grow: one is preempted, recomputed, and both
    # still produce exactly the mock's tokens (also where a first token, drawn with the
    # prompt, is pending when its sequence is preempted).
    engine, _ = _engine("fcfs", batch=2, resident=2, pages=1 + 9, draws_first_tokens=draws_first)
    seqs = _generate(engine, [_prompt(1, 8), _prompt(2, 8)], [RequestSettings(10)] * 2)
    outs = [s.output for s in seqs]
    assert sum(s.preemptions for s in seqs) >= 1
    assert [o.token_ids for o in outs] == [[token_of(r, i) for i in range(10)] for r in (1, 2)]
    assert engine.pages_in_use == 0


def test_a_first_token_drawn_with_the_prompt_streams_in_that_round_and_runs_next():
    # A device that draws a new row's first token when it is inserted: the round that
    # prefills the prompt streams token 0; the next burst (K = 2) runs it (the mock checks it
    # lands in the row's page at its position) and draws token 1; every pass counted once.
    engine, backend = _engine("fcfs", draws_first_tokens=True)
    handle = engine.submit(_prompt(1, 6), RequestSettings(5))
    engine.step()
    assert handle.delta().token_ids == [token_of(1, 0)] and backend.decode_log == []
    engine.step()
    assert handle.delta().token_ids == [token_of(1, 1)] and backend.decode_log == [[1]]
    out = handle.result()
    assert out.token_ids == [token_of(1, i) for i in range(5)]
    assert out.metrics["model_passes"] == 5 and engine.model_passes == 5
    # A request of one token ends with its prompt's round: no decode, its pages back.
    one = engine.submit(_prompt(2, 6), RequestSettings(1))
    engine.step()
    assert one.done and one.output.token_ids == [token_of(2, 0)]
    assert backend.decode_log == [[1]] * 3 and engine.pages_in_use == 0


def test_cancel_releases_pages_and_keeps_the_rest_running():
    engine, _ = _engine("fcfs", batch=2)
    a = engine.submit(_prompt(1, 6), RequestSettings(50))
    b = engine.submit(_prompt(2, 6), RequestSettings(6))
    engine.step()
    engine.step()
    a.cancel()
    assert b.result().finish_reason == "length" and len(b.result().token_ids) == 6
    assert a.result().finish_reason == "cancelled" and len(a.result().token_ids) < 50
    engine.run_until_idle()
    assert engine.pages_in_use == 0


def test_eos_finishes_a_request():
    engine, _ = _engine("fcfs", eos_at={1: 3})
    (out,) = engine.generate([_prompt(1, 5)], [RequestSettings(10)])
    assert out.finish_reason == "eos" and len(out.token_ids) == 4


def test_a_request_larger_than_the_pool_is_refused_by_name():
    engine, _ = _engine("fcfs", pages=8)
    with pytest.raises(
        RequestError,
        match=r"needs 9 KV pages \(with a burst of steps_per_sync=2 to spare\); the pool has 7",
    ):
        engine.submit(_prompt(1, 20), RequestSettings(12))


def test_a_request_longer_than_the_engine_s_context_is_refused_by_name():
    # 20 prompt tokens + 11 new ones need 31 positions; the engine serves 30 (its options'
    # max_context or the model's context, as the backend reports it). 30 exactly is served.
    engine, _ = _engine("fcfs", context_limit=30)
    with pytest.raises(RequestError, match=r"needs 31 positions but the engine's context is 30"):
        engine.submit(_prompt(1, 20), RequestSettings(11))
    good = engine.submit(_prompt(2, 20), RequestSettings(10))
    assert good.result().token_ids == [token_of(2, i) for i in range(10)]


@pytest.mark.parametrize(
    "prompt, new, match",
    [
        ([], 4, "no tokens"),
        ([3, 1000], 4, r"token 1 is 1000; token ids must be in \[0, 1000\)"),
        ([3, -1], 4, r"token 1 is -1"),
        ([3, 2.5], 4, "token ids are integers"),
        ([3, 4], 0, "max_new_tokens=0"),
    ],
)
def test_a_bad_request_is_refused_at_submit_and_the_engine_stays_usable(prompt, new, match):
    engine, _ = _engine("fcfs")
    with pytest.raises(RequestError, match=match):
        engine.submit(prompt, RequestSettings(new))
    good = engine.submit(_prompt(7, 5), RequestSettings(3))
    assert good.result().token_ids == [token_of(7, i) for i in range(3)]


def test_resident_limit_beyond_the_starvation_bound_is_refused():
    with pytest.raises(ValueError, match="min_advance_rounds"):
        _engine("fcfs", batch=2, resident=9, rounds=4)


def test_metrics_follow_the_engine_clock():
    engine, _ = _engine("fcfs", batch=1, resident=1, rounds=1)
    (out,) = engine.generate([_prompt(1, 4)], [RequestSettings(4)])
    m = out.metrics
    assert m["generated_tokens"] == 4 and m["prompt_tokens"] == 4
    assert 0 <= m["time_to_first_token"] <= m["end_to_end_latency"]
    assert m["per_token_latency"] >= 0


workloads = st.lists(
    st.tuples(
        st.integers(1, 30),  # prompt length
        st.integers(1, 12),  # max new tokens
        st.integers(0, 6),  # arrival round
        st.integers(0, 3),  # priority
        st.one_of(st.none(), st.integers(0, 11)),  # step at which it samples EOS
    ),
    min_size=1,
    max_size=10,
)


@settings(max_examples=examples(40), deadline=None)
@given(
    workload=workloads,
    policy=st.sampled_from(["fcfs", "priority", "entropic"]),
    batch=st.integers(1, 3),
    rounds=st.integers(1, 3),
    pages=st.integers(12, 40),
)
def test_any_workload_finishes_without_starvation_leaks_or_lost_tokens(
    workload, policy, batch, rounds, pages
):
    resident = batch * rounds
    entropy = {r: (4.0 + r % 3, 0.1 * (r % 4)) for r in range(1, len(workload) + 1)}
    eos = {r: w[4] for r, w in enumerate(workload, start=1) if w[4] is not None}
    engine, backend = _engine(policy, batch, resident, pages, rounds, entropy=entropy, eos_at=eos)
    handles = []
    for r, (length, new, arrival, priority, _) in enumerate(workload, start=1):
        if -(-(length + new - 1 + K) // PAGE) > pages - 1:
            continue  # refused at submission, tested above
        handles.append(
            (r, new, engine.submit(_prompt(r, length), RequestSettings(new), priority, arrival))
        )
    steps = 0
    while engine.step():
        steps += 1
        assert steps < 2000, "the engine stopped making progress"
    for r, new, h in handles:
        out = h.result()
        n = new if r not in eos or eos[r] >= new else eos[r] + 1
        assert out.token_ids[: n - (r in eos and eos[r] < new)] == [
            token_of(r, i) for i in range(n - (r in eos and eos[r] < new))
        ]
        assert len(out.token_ids) == n
    # Minimum advancement: between two runs of a resident sequence at most `rounds` rounds
    # pass, unless it was preempted in between (then it waits as a new request).
    unpreempted = [h.sequence for _, _, h in handles if h.sequence.preemptions == 0]
    gaps = _max_gaps(backend.decode_log)
    assert all(gaps[s.prompt[0]] <= rounds for s in unpreempted if s.prompt[0] in gaps)
    # ...and every run yields a token (K when nothing is prefilling), so a resident sequence
    # finishes within rounds * (its runs) rounds, with at most max_new_tokens runs.
    for s in unpreempted:
        runs = sum(s.prompt[0] in ids for ids in backend.decode_log)
        assert runs <= s.settings.max_new_tokens
        assert s.finish_round - s.resident_round <= rounds * runs
    assert engine.pages_in_use == 0 and len(engine.free_rows) == resident


def test_same_workload_same_schedule():
    def run():
        engine, backend = _engine("entropic", batch=2, resident=4, pages=30)
        outs = engine.generate(
            [_prompt(r, 3 + 4 * r) for r in range(1, 7)],
            [RequestSettings(5 + r) for r in range(1, 7)],
        )
        return backend.decode_log, [o.token_ids for o in outs]

    assert run() == run()


def test_rows_of_very_different_widths_run_as_separate_bursts():
    # Weights cost 100; a burst reads every row at its longest length. Three 6-token prompts
    # and one 90-token prompt: one burst costs 100 + 4 * 90 = 460 per step, two cost
    # (100 + 3 * 6) + (100 + 90) = 308, so the long row runs alone once it is resident.
    engine, backend = _engine(
        "fcfs", batch=4, resident=4, pages=256, weight_bytes=100.0, prefill_chunk=128
    )
    prompts = [_prompt(1, 6), _prompt(2, 6), _prompt(3, 6), _prompt(4, 90)]
    outs = engine.generate(prompts, [RequestSettings(4)] * 4)
    assert [1, 2, 3] in backend.decode_log and [4] in backend.decode_log
    assert engine.decode_bursts > engine.decode_rounds
    assert [o.token_ids for o in outs] == [[token_of(r, i) for i in range(4)] for r in (1, 2, 3, 4)]


def test_one_group_when_splitting_does_not_pay():
    # Weights cost 1000 against at most 4 * 10 for the rows: every round is one burst of all
    # the rows that decode. Prompts of 6-9 tokens, two prefilled per round in chunks of 8:
    # 0 and 1 first; they decode a token each beside 2 and 3's first chunks, then beside 3's
    # last token with 2; then all four run a K = 2 burst, which finishes 0 and 1.
    engine, backend = _engine("fcfs", batch=4, resident=4, pages=256, weight_bytes=1000.0)
    outs = engine.generate([_prompt(r, 6 + r) for r in range(4)], [RequestSettings(4)] * 4)
    assert engine.decode_bursts == engine.decode_rounds
    assert backend.decode_log == [[0, 1], [0, 1, 2], [0, 1, 2, 3], [2, 3]]
    assert [o.token_ids for o in outs] == [[token_of(r, i) for i in range(4)] for r in range(4)]


def test_first_tokens_drawn_with_their_prompts_come_a_round_earlier_and_change_nothing(
    tiny_hf_dir,
):
    # The device draws a new row's first token when it is inserted (etjax/runtime/steps.py
    # `first_token`); the reference is the same engine drawing it in the row's first decode
    # step, as before. Greedy with top log-probabilities, seeded top-p sampling and the
    # entropic controller, one prompt twice (a fork of its prefill): the same tokens and
    # trace (the cost and kept blocks of a first token included, reported when its pass
    # runs), each first token streamed in the round that prefilled its prompt, one round
    # before the reference's.
    import etjax
    from etjax.engine_build import build_engine

    tiny = etjax.load_model(tiny_hf_dir("llama"))
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, tiny.config.vocab_size, size=n).tolist() for n in (9, 21)]
    prompts.append(list(prompts[1]))
    samplers = [
        SamplerSettings(),
        SamplerSettings(temperature=0.9, top_p=0.9, seed=7),
        SamplerSettings(sampler="entropic", temperature=1.0, seed=3),
    ]
    settings = [RequestSettings(6, sampler=s, logprobs=2 * (s == samplers[0])) for s in samplers]
    options = RuntimeOptions(page_size=4, steps_per_sync=4, prefill_chunk=32)

    def run(draws_first: bool):
        engine = build_engine(tiny.weights, tiny.config, tiny.tokenizer, options, num_pages=64)
        engine.backend.draws_first_tokens = draws_first
        handles = [engine.submit(p, s) for p, s in zip(prompts, settings, strict=True)]
        first_round, rounds = {}, 0
        while engine.step():
            rounds += 1
            for i, h in enumerate(handles):
                if h.output.token_ids:
                    first_round.setdefault(i, rounds)
        return [h.output for h in handles], first_round

    (outputs, first), (reference, later) = run(True), run(False)
    assert first == {i: r - 1 for i, r in later.items()}
    for out, ref in zip(outputs, reference, strict=True):
        assert out.token_ids == ref.token_ids and out.top_logprobs == ref.top_logprobs
        assert out.metrics["model_passes"] == ref.metrics["model_passes"] == 6
        for name in TRACE_FIELDS:  # a draw outside a step may round its last bit differently
            np.testing.assert_allclose(getattr(out, name), getattr(ref, name), rtol=1e-6)
