"""Multi-process batch jobs on `jax.distributed` (local CPU processes): the merged output of two
processes equals a one-process run, and a process that dies is reported, not waited for
forever."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

from etjax.cli import main
from tests.subprocess_env import ROOT, subprocess_env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _batch_process(model: Path, input_path: Path, output: Path, *flags: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "etjax.cli", "batch", "--input", str(input_path)]
    command += ["--output", str(output), "--model", str(model), "--no-progress", *flags]
    return subprocess.Popen(
        command,
        env=subprocess_env(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _write_input(path: Path) -> None:
    lines = [{"id": f"r{i}", "prompt": f"Story number {i}:", "max_new_tokens": 6} for i in range(7)]
    lines.insert(3, {"id": "bad", "prompt": ""})  # an error record travels through the merge
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_two_processes_merge_to_the_one_process_output(tiny_hf_dir, tmp_path):
    model = tiny_hf_dir("llama")
    source = tmp_path / "in.jsonl"
    _write_input(source)
    single = tmp_path / "single.jsonl"
    args = ["batch", "--input", str(source), "--output", str(single)]
    assert main([*args, "--model", str(model), "--no-progress"]) == 0

    merged = tmp_path / "multi.jsonl"
    port = _free_port()
    procs = [
        _batch_process(
            model,
            source,
            merged,
            "--coordinator",
            f"localhost:{port}",
            "--process-count",
            "2",
            "--process-index",
            str(i),
            "--timeout",
            "120",
        )
        for i in range(2)
    ]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]

    ours, reference = _read(merged), _read(single)
    assert [r["id"] for r in ours] == ["r0", "r1", "r2", "bad", "r3", "r4", "r5", "r6"]
    by_id = {r["id"]: r for r in reference}
    for record in ours:
        want = by_id[record["id"]]
        assert record.get("token_ids") == want.get("token_ids")
        assert record.get("error") == want.get("error")


def test_a_process_that_dies_is_reported_within_the_timeout(tiny_hf_dir, tmp_path):
    source = tmp_path / "in.jsonl"
    _write_input(source)
    port = _free_port()
    # Process 1 joins the job, then dies before doing its shard. Process 0 starts once process
    # 1 has imported JAX and is about to join, so joining takes no time whatever the machine's
    # load, and the job's timeout, which bounds joining as well as the barrier (and the
    # runtime's heartbeat check, at twice that), can be short: it is spent waiting.
    doomed = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, jax; print('joining', flush=True); "
            f"jax.distributed.initialize('localhost:{port}', 2, 1, heartbeat_timeout_seconds=40); "
            "os._exit(1)",
        ],
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert doomed.stdout.readline() == "joining\n", doomed.communicate()[1]
    survivor = _batch_process(
        tiny_hf_dir("llama"),
        source,
        tmp_path / "out.jsonl",
        "--coordinator",
        f"localhost:{port}",
        "--process-count",
        "2",
        "--process-index",
        "0",
        "--timeout",
        "2",
    )
    doomed.communicate(timeout=120)
    assert doomed.returncode == 1
    started = time.monotonic()
    _, err = survivor.communicate(timeout=300)
    assert survivor.returncode != 0
    # Whichever comes first: etjax's barrier timeout, or the runtime's heartbeat check, which
    # terminates the survivors itself. Both name what happened.
    ours = "not every process reached" in err and "died or is stuck" in err
    runtime = "stopped sending heartbeats" in err and "another task died" in err
    assert ours or runtime, err[-3000:]
    assert time.monotonic() - started < 200
