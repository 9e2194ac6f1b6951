"""`etjax bench` end to end on SmolLM2, small: three short requests, three configs, one
repetition, every quality column and the transformers reference.

The independent truths: transformers' greedy outputs equal etjax's baseline greedy outputs
(up to rare float near-ties), a config that differs from the baseline only in scheduling
reproduces its sampled tokens exactly, and an unpruned config has a perplexity ratio of 1.
"""

from __future__ import annotations

import json

import pytest

from etjax.cli import main

pytestmark = pytest.mark.real_model  # the bench runs SmolLM2


@pytest.mark.compile_bound  # etjax against itself over two short requests
def test_bench_timing_only_run_writes_its_files(tmp_path, capsys):
    # The default suite's run: two configs, two short requests, no quality or reference. The
    # requests come from a workload file, a few tokens each: the `mixed` workload's two would
    # generate up to 162 and 194 tokens under each config, most of the test's time.
    workload = tmp_path / "short.jsonl"
    records = [
        {"prompt": "The river", "max_new_tokens": 12},
        {"prompt": "Write one sentence about the sea.", "max_new_tokens": 20},
    ]
    workload.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "bench"
    code = main(
        [
            "bench",
            "--workload",
            str(workload),
            "--configs",
            "baseline,scheduling_only",
            "--repetitions",
            "1",
            "--no-quality",
            "--no-reference",
            "--output",
            str(out),
            "--no-progress",
        ]
    )
    assert code == 0, capsys.readouterr().err
    raw = json.loads((out / "short" / "results.json").read_text())
    assert raw["same_tokens_as"] == {"scheduling_only": "baseline"}
    table = (out / "short" / "table.md").read_text()
    assert "| scheduling_only |" in table and "| relative to baseline |" in table
    assert (out / "short" / "latency_cdf.png").stat().st_size > 0


@pytest.mark.slow
def test_bench_writes_results_table_and_plots(tmp_path, capsys):
    out, perf = tmp_path / "bench", tmp_path / "PERF.md"
    code = main(
        [
            "bench",
            "--workload",
            "mixed",
            "--configs",
            "baseline,scheduling_only,full",
            "--requests",
            "3",  # short prompts only: the workload's long documents are every fourth
            "--repetitions",
            "1",
            "--ppl-docs",
            "1",
            "--ppl-length",
            "1024",
            "--passkey-lengths",
            "256",
            "--reference-batch",
            "3",
            "--output",
            str(out),
            "--perf-md",
            str(perf),
            "--no-progress",
        ]
    )
    assert code == 0, capsys.readouterr().err
    folder = out / "mixed"
    for name in ("results.json", "table.md", "traces.png", "latency_cdf.png", "throughput.png"):
        assert (folder / name).stat().st_size > 0, name
    raw = json.loads((folder / "results.json").read_text())
    assert set(raw["runs"]) == {"baseline", "scheduling_only", "full"}
    assert raw["same_tokens_as"].get("scheduling_only") == "baseline"
    rows = raw["quality"]["rows"]
    assert rows["baseline"]["rouge_l"] == 1.0 and rows["baseline"]["ppl_ratio"] == 1.0
    assert rows["scheduling_only"]["evaluated_as"] == "baseline"
    assert rows["full"]["evaluated_as"] == "full"
    assert 0.0 < rows["full"]["ppl_kept_fraction"] <= 1.0
    assert raw["reference"]["rouge_l_vs_baseline"] > 0.9
    for run in raw["runs"]["full"]:
        assert sum(r["generated_tokens"] for r in run["requests"]) > 0
    text = perf.read_text()
    assert "<!-- begin ablation_mixed -->" in text and "](bench/mixed/traces.png)" in text
    assert "| transformers generate (greedy, batch 3) |" in text
