"""`etjax bench`: workloads, the figures it derives and its tables, checked against values
computed by hand, and its command line's refusals of bad input."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

import etjax
from etjax.bench.ablation import BenchPlan
from etjax.bench.accelerators import ACCELERATORS, predicted_tokens_per_s
from etjax.bench.measure import _request_record, summarise
from etjax.bench.reference import _until_stop, run_reference
from etjax.bench.report import additivity, cost_table, relative_table
from etjax.bench.text_metrics import corpus_bleu, rouge_l
from etjax.bench.workload_file import read_workload_file, run_label, workload_label
from etjax.bench.workloads import (
    WorkloadRequest,
    build_workload,
    long,
    long_output,
    mixed,
    poisson_arrivals,
    shared,
)
from etjax.cli import main
from etjax.entropy.cost import CostModel
from etjax.errors import ConfigError
from etjax.runtime.options import SequenceOutput


def test_mixed_workload_is_seeded_and_shaped_as_documented(smollm2, lee):
    first = mixed(smollm2.tokenizer, lee, 16, seed=3)
    assert first == mixed(smollm2.tokenizer, lee, 16, seed=3)
    assert first != mixed(smollm2.tokenizer, lee, 16, seed=4)
    assert [r.kind == "long" for r in first] == [i % 4 == 3 for i in range(16)]
    for r in first:
        assert 64 <= r.max_new_tokens <= 256
        n = len(smollm2.tokenizer.encode(r.prompt))
        if r.kind == "long":
            assert 2048 - 64 <= n <= 6144 + 64
        else:
            assert n <= 384 + 64


def _shared_start(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))


def test_shared_workload_is_seeded_and_its_groups_start_alike(smollm2, lee):
    tok = smollm2.tokenizer
    first = shared(tok, lee, 14, seed=3)
    assert first == shared(tok, lee, 14, seed=3) and first != shared(tok, lee, 14, seed=4)
    kinds = ["document"] * 4 + ["instruction"] * 4 + ["samples"] * 4 + ["document"] * 2
    assert [r.kind for r in first] == kinds
    assert all(32 <= r.max_new_tokens <= 96 for r in first)
    groups = [first[0:4], first[4:8], first[8:12]]
    ids = [[tok.encode(r.prompt) for r in g] for g in groups]
    common = [min(_shared_start(a, b) for a in g for b in g if a != b) for g in ids[:2]]
    # Four questions after one 1.5K-3K-token document; four tasks after one block of
    # about 600 tokens; one prompt four times.
    assert 1536 - 16 <= common[0] <= 3072 + 16 and common[1] >= 400
    assert all(p == ids[2][0] for p in ids[2])
    assert build_workload("shared", tok, lee, 14, 3) == first


def test_long_workload_fits_the_model_s_context_and_asks_long_outputs(smollm2, lee):
    tok = smollm2.tokenizer
    first = build_workload("long", tok, lee, 8, 1, context=8192)
    assert first == long(tok, lee, 8, seed=1, context=8192) != long(tok, lee, 8, seed=2)
    assert [r.kind for r in first] == (["question"] * 3 + ["continue"]) * 2
    for r in first:
        n = len(tok.encode(r.prompt))
        assert 256 <= r.max_new_tokens <= 1024 and n >= 4096 and n + r.max_new_tokens <= 8192
    # The four requests on a document share it: the continuation is the document itself.
    assert first[0].prompt.startswith(first[3].prompt) and first[4].prompt != first[0].prompt


def test_long_output_workload_asks_long_generations_of_short_prompts(smollm2, lee):
    tok = smollm2.tokenizer
    first = build_workload("long_output", tok, lee, 6, 1, context=2048)
    assert first == long_output(tok, lee, 6, seed=1, context=2048) != long_output(tok, lee, 6, 2)
    for r in first:
        n = len(tok.encode(r.prompt))
        # Outputs of 1,024-4,096 tokens, cut to what the 2K context leaves after the prompt.
        assert n <= 420 and min(1024, 2047 - n) <= r.max_new_tokens <= 2047 - n


def test_a_workload_file_is_read_checked_and_tokenized(smollm2, tmp_path):
    path = tmp_path / "mine.jsonl"
    chat = [{"role": "user", "content": "Hi there"}]
    path.write_text(
        json.dumps({"id": "a", "prompt": "The river", "max_new_tokens": 5, "arrival": 1.5})
        + "\n\n"
        + json.dumps({"messages": chat, "priority": 2})
        + "\n"
    )
    a, b = read_workload_file(path, smollm2)
    assert (a.kind, a.max_new_tokens, a.arrival, a.priority) == ("prompt", 5, 1.5, 0.0)
    assert a.token_ids(smollm2.tokenizer) == smollm2.tokenizer.encode("The river")
    (expected,) = etjax.decode([chat], model=smollm2, max_new_tokens=1)
    assert list(b.prompt_ids) == expected.prompt_token_ids and b.priority == 2
    assert b.max_new_tokens == 128 and workload_label(str(path)) == "mine"


def test_runs_are_filed_apart_by_load_and_equal_length():
    # Online runs at two loads, and a plain and an equal-length run, must not overwrite
    # each other's folder or PERF.md section.
    assert run_label("online", False, 0.8) == "online_load0.8"
    assert run_label("online", True, 1.2) == "online_load1.2_equal"
    assert run_label("long", True, 0.8) == "long_equal"  # at once: the load plays no part
    assert run_label("long", True, 0.8, arrivals=True) == "long_load0.8_equal"
    assert run_label("runs/mine.jsonl", False, 0.8) == "mine"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"prompt": "x", "temperature": 0.5}', "field 'temperature' is not read"),
        ('{"prompt": "x", "messages": []}', 'give "prompt"'),
        ('{"prompt": "x", "arrival": -1}', "arrival=-1"),
        ('{"prompt": "x", "max_new_tokens": "3"}', "max_new_tokens='3'; must be an integer"),
        ("{nope", "not valid JSON"),
        ('{"prompt": ""}', "prompt 0 is empty"),
    ],
)
def test_a_bad_workload_line_stops_the_benchmark_by_file_and_line(smollm2, tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ConfigError, match=re.escape(f"{path}, line 1: {message}")):
        read_workload_file(path, smollm2)


def test_poisson_arrivals_have_the_requested_rate():
    arrivals = poisson_arrivals(20_000, rate=4.0, seed=0)
    assert arrivals[0] == 0.0 and np.all(np.diff(arrivals) >= 0)
    # Mean gap 1/rate; its standard error with n gaps is (1/rate)/sqrt(n) = 0.0018.
    assert abs(np.diff(arrivals).mean() - 0.25) < 0.01


def test_request_record_counts_kept_blocks_by_hand():
    cost = CostModel(
        matmul_flops_per_token=1.0,
        attention_flops_per_key=1.0,
        weight_bytes=1.0,
        kv_bytes_per_key=10.0,
        page_size=4,
    )
    out = SequenceOutput(token_ids=[5, 6, 7], logprob=[-1.0, -2.0, -3.0])
    out.kept_blocks = [2, 1, 0]  # passes after tokens 0 and 1; none after the last
    for field in ("entropy", "sampled_entropy", "temperature", "tau"):
        setattr(out, field, [0.0, 0.0, 0.0])
    out.metrics = {"end_to_end_latency": 1.0, "cost_bytes": 500.0}
    record = _request_record(out, prompt_tokens=6, cost=cost)
    # After token 0: 7 positions = 2 pages, both read; after token 1: 8 positions = 2 pages, 1 read.
    assert record["kept_fraction"] == pytest.approx((2 / 2 + 1 / 2) / 2)
    assert record["kv_bytes"] == (2 + 1) * 4 * 10.0
    assert record["decode_steps"] == 2
    assert record["mean_logprob"] == pytest.approx(-2.0)
    # The pass after token 0 read 1.5 of its blocks once for rows sharing them (less its own
    # share): 6 keys fewer read, 60 bytes, in the KV and in the cost; attention's FLOPs still
    # count all 12 keys.
    out.shared_blocks = [1.5, 0.0, 0.0]
    record = _request_record(out, prompt_tokens=6, cost=cost)
    assert record["kv_bytes"] == (12 - 6) * 10.0
    assert record["cost_bytes"] == 500.0 - 60.0
    assert record["keys_attended"] == 12


def _request(latency, ttft, tokens, tau, cost, kept, steps, kv):
    return {
        "end_to_end_latency": latency,
        "time_to_first_token": ttft,
        "generated_tokens": tokens,
        "tau": tau,
        "cost_bytes": cost,
        "kept_fraction": kept,
        "decode_steps": steps,
        "kv_bytes": kv,
        "preemptions": 0.0,
    }


def test_summary_figures_by_hand():
    run = {
        "throughput_tok_s": 7.0,
        "host_ms_per_step": 1.0,
        "compile_s": 0.5,
        "requests": [
            _request(2.0, 0.5, 10, 3.0, 1e9, 1.0, 9, 4e6),
            _request(4.0, 1.5, 30, 1.0, 3e9, 0.5, 29, 6e6),
        ],
    }
    s = summarise(run)
    assert s["latency_mean_s"] == 3.0 and s["ttft_mean_s"] == 1.0
    assert s["latency_p50_s"] == 3.0
    assert s["dtau_dc_per_gb"] == pytest.approx(4.0 / 4.0)
    assert s["kept_fraction"] == pytest.approx((9 * 1.0 + 29 * 0.5) / 38)
    assert s["kv_mb_per_token"] == pytest.approx(10e6 / 40 / 1e6)


def test_bytes_and_flops_per_token_by_hand_and_their_roofline():
    # 40 tokens in 20 model passes of a 200 MB model: 100 MB of weights per token; 10 MB of KV
    # (0.25 MB per token) at 1 kB per key is 10^4 keys; 50 tokens run (10 drafted) at 1 GFLOP
    # each, plus 1 kFLOP per key: 5.001e10 FLOPs, 1.25025 GFLOP per generated token.
    requests = [
        _request(2.0, 0.5, 10, 3.0, 1e9, 1.0, 9, 4e6),
        _request(4.0, 1.5, 30, 1.0, 3e9, 0.5, 29, 6e6) | {"drafted_tokens": 10.0},
    ]
    run = {
        "throughput_tok_s": 7.0,
        "host_ms_per_step": 1.0,
        "model_passes": 20,
        "cost": {
            "weight_bytes": 2e8,
            "matmul_flops_per_token": 1e9,
            "attention_flops_per_key": 1e3,
            "kv_bytes_per_key": 1e3,
        },
        "requests": requests,
    }
    s = summarise(run)
    assert s["weight_mb_per_token"] == pytest.approx(100.0)
    assert s["gflop_per_token"] == pytest.approx(1.25025)
    v5e = ACCELERATORS[0]
    # Memory-bound: 819 MB per token at 819 GB/s; compute-bound: 1.97 TFLOP at 197 TFLOP/s.
    assert predicted_tokens_per_s(v5e, 819e6, 1e9) == pytest.approx(1000.0)
    assert predicted_tokens_per_s(v5e, 1.0, 1.97e12) == pytest.approx(100.0)
    raw = {"summary": {"baseline": [s], "other": [s | {"kv_mb_per_token": 0.0}]}}
    raw["weights"] = "q4_1+q8_0"
    table = cost_table(raw)
    # 100.25 MB (10 MB of KV over 40 tokens) and 1.25 GFLOP per token: memory-bound on all
    # three; an H100 reads it 3,350e9 / 100.25e6 = 33,416 times a second.
    row = "| baseline | q4_1+q8_0 | 100.0 | 0.2 | 1.25 | 1.00 | 8,170 | 16,359 | 33,416 |"
    assert row in table
    assert "roofline model, not a measurement" in table


def _summary(latency, throughput, dtau):
    return {
        "latency_mean_s": latency,
        "latency_p50_s": latency,
        "latency_p99_s": latency,
        "ttft_mean_s": 1.0,
        "throughput_tok_s": throughput,
        "dtau_dc_per_gb": dtau,
    }


def test_additivity_compares_the_full_gain_with_the_summed_level_gains():
    raw = {
        "summary": {
            "baseline": [_summary(10.0, 100.0, 1.0)],
            "sampling_only": [_summary(10.0, 110.0, 1.0)],  # 1.1x throughput
            "scheduling_only": [_summary(8.0, 120.0, 1.0)],  # 1.25x latency, 1.2x throughput
            "pruning_only": [_summary(10.0, 100.0, 1.5)],
            "full": [_summary(5.0, 125.0, 1.2)],
        }
    }
    lines = additivity(raw).splitlines()
    # latency: gains 1, 1.25, 1 add to 1.25; full 10/5 = 2.0 -> super-additive.
    assert "full loop 2.00x" in lines[0] and "add to 1.25x" in lines[0]
    assert "**super-additive**" in lines[0]
    # throughput: 1.1 + 1.2 + 1 add to 1.30; full 1.25 -> not.
    assert "add to 1.30x" in lines[1] and "not super-additive" in lines[1]
    # d tau / d C: 1 + 1 + 1.5 add to 1.50; full 1.2 -> not.
    assert "add to 1.50x" in lines[2] and "not super-additive" in lines[2]
    table = relative_table(raw)
    assert "| full | 0.50 | 0.50 | 0.50 | 1.00 | 1.25 | 1.20 |" in table


def test_text_metrics_on_known_pairs():
    assert rouge_l(["the cat sat"], ["the cat sat"]) == [1.0]
    assert rouge_l(["dog runs"], ["the cat sat"]) == [0.0]
    # LCS "the sat" = 2 of 3 and 2 of 2 tokens: F = 2 * (2/2 * 2/3) / (2/2 + 2/3) = 0.8.
    assert rouge_l(["the sat"], ["the cat sat"])[0] == pytest.approx(0.8)
    # No Latin tokens at all: identical outputs still match, different ones cannot be scored.
    assert rouge_l(["好的。", "！"], ["好的。", "？"]) == [1.0, 0.0]
    assert corpus_bleu(["a b c d e"], ["a b c d e"]) == pytest.approx(100.0)


def test_reference_outputs_stop_at_eos_and_the_request_limit():
    assert _until_stop([1, 2, 0, 0, 0], eos=[0], limit=5) == [1, 2, 0]
    assert _until_stop([1, 2, 3, 4], eos=[0], limit=3) == [1, 2, 3]


def test_equal_length_reference_runs_past_eos_to_the_limit(smollm2, hf_smollm2):
    # A chat answer that ends within 12 tokens: plain, it stops at its EOS; equal length, the
    # same greedy tokens go on to exactly the limit (the work `--equal-length` engines do).
    ids = smollm2.tokenizer.encode_chat(
        [{"role": "user", "content": "What is 2+2? Answer with just the number."}]
    )
    request = WorkloadRequest(kind="file", prompt="", max_new_tokens=12, prompt_ids=tuple(ids))
    plain = run_reference(hf_smollm2, smollm2.tokenizer, [request])["requests"][0]
    equal = run_reference(hf_smollm2, smollm2.tokenizer, [request], equal_length=True)
    equal = equal["requests"][0]
    eos = set(smollm2.tokenizer.eos_token_ids)
    assert plain["token_ids"][-1] in eos and len(plain["token_ids"]) < 12
    assert len(equal["token_ids"]) == 12
    assert equal["token_ids"][: len(plain["token_ids"])] == plain["token_ids"]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("workload", "bursty", "allowed"),
        ("requests", 0, "must be positive"),
        ("load", 1.5, "(0, 1]"),
        ("configs", (), "at least one"),
    ],
)
def test_bench_plan_refuses_bad_values(field, value, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("]", r"\]")):
        BenchPlan(**{field: value})
    # a workload file's records carry their own arrival times
    with pytest.raises(ConfigError, match=r"mine\.jsonl is a workload file"):
        BenchPlan(workload="runs/mine.jsonl", arrivals=True)


def test_bench_cli_names_the_bad_flag(capsys):
    assert main(["bench", "--workload", "bursty", "--no-progress"]) == 2
    assert "workload 'bursty'" in capsys.readouterr().err
    assert main(["bench", "--passkey-lengths", "1k", "--no-progress"]) == 2
    assert "--passkey-lengths='1k'" in capsys.readouterr().err
    assert main(["bench", "--configs", "baseline,nope", "--no-progress"]) == 2
    assert "config 'nope' not found" in capsys.readouterr().err


@pytest.mark.parametrize("workload", ["mixed", "online", "long+arrivals", "file"])
def test_ablation_warms_every_setting_before_timing_and_counts_its_work(
    monkeypatch, smollm2, workload, tmp_path
):
    # `measure` is replaced by a recorder: this checks the order of the work around it (the real
    # runs are in test_bench_smollm2.py).
    from etjax.bench import ablation

    monkeypatch.setattr("etjax.load_model", lambda *a, **k: smollm2)
    monkeypatch.setattr(ablation, "summarise", lambda run: {})
    calls = []

    def record(model, config, requests, arrivals, greedy=False, equal_length=False):
        assert equal_length  # the plan's, passed to every run
        calls.append((config.name, float(np.max(arrivals))))
        return {
            "makespan_s": 8.0,
            "compile_s": 2.0 if len(calls) == 1 else 0.0,
            "programs_compiled": 3 if len(calls) == 1 else 0,
            "requests": [{"token_ids": [1]}] * len(requests),
        }

    monkeypatch.setattr(ablation, "measure", record)
    if workload == "file":  # its own arrivals, in seconds
        workload = str(tmp_path / "own.jsonl")
        lines = [{"prompt": "The river", "arrival": a} for a in (0, 2.5, 1)]
        Path(workload).write_text("\n".join(map(json.dumps, lines)) + "\n")
    arrivals = workload == "long+arrivals"
    plan = BenchPlan(
        workload=workload.removesuffix("+arrivals"),
        arrivals=arrivals,
        configs=("baseline", "scheduling_only", "full"),
        requests=8,
        quality=False,
        reference=False,
        equal_length=True,
    )
    progress = []
    raw = ablation.run_ablation(plan, on_progress=progress.append)
    assert len(progress) == len(calls) == ablation.count_work(plan)
    timed = calls[-6:]
    assert [name for name, _ in timed] == ["baseline", "scheduling_only", "full"] * 2
    # The cold (first) run of each setting is what the report's compile figures come from.
    assert raw["warm_up"]["baseline"] == {"compile_s": 2.0, "programs_compiled": 3}
    if workload == "mixed":
        assert calls[:3] == [(n, 0.0) for n in ("baseline", "scheduling_only", "full")]
        assert all(last == 0.0 for _, last in timed)
    elif workload.endswith(".jsonl"):
        assert raw["arrivals"] == [[0.0, 2.5, 1.0]] * 2 and len(raw["workload"]) == 3
        assert all(last == 2.5 for _, last in calls)
    else:
        # At once: the first config warms and measures capacity (8 requests / 8 s); then
        # every setting warms with the first repetition's arrivals. Each repetition draws its
        # own (seeds 1 and 2, at 80% of 1 request/s), which every config of it gets.
        assert calls[:2] == [("baseline", 0.0), ("baseline", 0.0)]
        assert raw["capacity_requests_per_s"] == pytest.approx(1.0)
        draws = [poisson_arrivals(8, 0.8, seed=s) for s in (1, 2)]
        np.testing.assert_allclose(raw["arrivals"], draws)
        first, second = (float(max(d)) for d in draws)
        assert 0 < first != second
        assert calls[2:5] == [(n, first) for n in ("baseline", "scheduling_only", "full")]
        assert [last for _, last in timed] == [first] * 3 + [second] * 3


def test_the_perf_section_links_only_plots_under_its_own_folder(tmp_path):
    from etjax.bench.output import _plot_links

    document = tmp_path / "docs" / "PERF.md"
    inside = [tmp_path / "docs" / "bench" / "long" / "traces.png"]
    assert _plot_links(inside, inside[0].parent, document) == "![traces](bench/long/traces.png)"
    outside = [tmp_path / "scratch" / "traces.png"]
    assert "not linked" in _plot_links(outside, outside[0].parent, document)
