"""Faults a batch job meets in the field, tried with real processes and real signals: SIGTERM
and SIGINT (a preempted VM, Ctrl-C), a write that fails (a full disk, here a file-size limit),
and a second process on the same output (a lock left by a killed job: tests/test_batch_job.py's
SIGKILL). In each, what was written stays valid and a rerun of the same command completes the
job with every id exactly once. The faults hit job processes; the reruns run in this process
(`_rerun`): a process each would pay for its imports, model load and trace again, and this
one reads the job's programs once for all of them from the run's cache, where the first job
compiled them (tests/subprocess_env.py)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from etjax.errors import JobError
from etjax.jobs.output_lock import lock_path, output_lock
from tests.subprocess_env import subprocess_env
from tests.test_batch_job import CONFIG as SMALL_JOB

CONFIG = SMALL_JOB.format(new=48)  # long enough to be caught mid-run
RECORDS = 10


def _job(tmp_path: Path, tiny_hf_dir, out: Path, records: int = RECORDS) -> list[str]:
    src = tmp_path / "in.jsonl"
    if not src.exists():
        lines = [json.dumps({"id": i, "prompt": f"Story number {i}:"}) for i in range(records)]
        src.write_text("\n".join(lines) + "\n")
        (tmp_path / "small.toml").write_text(CONFIG)
    return [
        *(sys.executable, "-m", "etjax.cli", "batch", "--input", str(src)),
        *("--output", str(out), "--config", str(tmp_path / "small.toml")),
        *("--model", str(tiny_hf_dir("llama")), "--no-progress"),
    ]


def _rerun(command: list[str]) -> None:
    # `command` without `python -m etjax.cli`: the same arguments, to the same entry point.
    from etjax.cli import main

    assert main(command[3:]) == 0


def _wait_for_lines(job: subprocess.Popen, out: Path, lines: int) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and job.poll() is None:
        if out.exists() and out.read_bytes().count(b"\n") >= lines:
            return
        time.sleep(0.02)
    raise AssertionError("the job ended (or hung) before writing; make it longer")


def _wait_for_lock(job: subprocess.Popen, out: Path) -> None:
    deadline, lock = time.monotonic() + 300, lock_path(out)
    while time.monotonic() < deadline and job.poll() is None:
        with contextlib.suppress(FileNotFoundError):
            if lock.read_text().strip() == str(job.pid):
                return
        time.sleep(0.02)
    raise AssertionError("the job ended (or hung) before taking its output's lock")


def _ids_once_each(out: Path) -> None:
    data = out.read_bytes()
    assert data.endswith(b"\n")
    ids = [json.loads(line)["id"] for line in data.splitlines()]
    assert sorted(int(i) for i in ids) == list(range(RECORDS))


@pytest.mark.parametrize("number", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_saves_what_is_done_and_a_rerun_completes(tiny_hf_dir, tmp_path, number):
    out = tmp_path / "out.jsonl"
    command, env = _job(tmp_path, tiny_hf_dir, out), subprocess_env()
    job = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    _wait_for_lines(job, out, 2)
    job.send_signal(number)
    _, stderr = job.communicate(timeout=120)
    assert job.returncode == 128 + number, stderr
    assert f"stopped by {signal.Signals(number).name}" in stderr
    assert "Rerun the same command to resume" in stderr
    kept = [json.loads(line) for line in out.read_bytes().splitlines()]  # every line whole
    assert 2 <= len(kept) < RECORDS
    assert f"the {len(kept)} results in {out}" in stderr
    assert not lock_path(out).exists()  # released on the way out
    _rerun(command)
    _ids_once_each(out)


def test_a_failed_write_stops_with_the_file_named_and_a_rerun_completes(tiny_hf_dir, tmp_path):
    # RLIMIT_FSIZE makes the kernel refuse writes past the limit (EFBIG), as a full disk
    # refuses them (ENOSPC): the job must stop, cut the half-written line and name the file.
    out = tmp_path / "out.jsonl"
    command, env = _job(tmp_path, tiny_hf_dir, out), subprocess_env()
    # The run's cache is read but not written: an entry would exceed the limit too. The
    # signal tests above compiled this job's programs into it.
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "1e9"
    limit = 1500  # two or three result lines
    # A small launcher sets the limit and execs the job (no preexec_fn: forking this
    # multithreaded test process to run Python in the child can deadlock).
    launcher = (
        "import os, resource, sys; "
        f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit})); "
        "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
    )
    failed = subprocess.run(
        [sys.executable, "-c", launcher, *command[1:]], env=env, capture_output=True, text=True
    )
    assert failed.returncode == 2, failed.stderr
    assert f"cannot write to {out}: File too large" in failed.stderr
    assert "rerun the same command to resume" in failed.stderr
    data = out.read_bytes()
    assert data.endswith(b"\n") and len(data) <= limit  # only whole lines remain
    kept = [json.loads(line) for line in data.splitlines()]
    assert 1 <= len(kept) < RECORDS
    assert f"its {len(kept)} complete results are intact" in failed.stderr
    _rerun(command)
    _ids_once_each(out)


def test_a_second_process_on_the_same_output_is_refused(tiny_hf_dir, tmp_path):
    out = tmp_path / "out.jsonl"
    # Long enough to be still running when the second process, started once the first holds
    # the lock (it takes it before loading the model), has imported JAX and asks for it: the
    # second starts while the first loads, not after, so the first generates less meanwhile.
    command = _job(tmp_path, tiny_hf_dir, out, records=1000)
    env = subprocess_env()
    first = subprocess.Popen(command, env=env, stderr=subprocess.DEVNULL)
    _wait_for_lock(first, out)
    second = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert first.poll() is None, "the first job ended too soon to test the lock"
    assert second.returncode == 2
    assert f"{out} is being written by another etjax process (pid {first.pid}" in second.stderr
    # The lock itself, taken here, in a process apart from its holder: refused alike.
    refused = f"another etjax process \\(pid {first.pid}"
    with pytest.raises(JobError, match=refused), output_lock(out):
        pass
    _wait_for_lines(first, out, 1)  # the first job writes on
    first.send_signal(signal.SIGTERM)
    first.wait(timeout=120)
    ids = [json.loads(line)["id"] for line in out.read_bytes().splitlines()]
    assert len(ids) == len(set(ids))  # the refused process wrote nothing


def test_the_lock_is_reentrant_within_a_process(tmp_path):
    # Exclusive across processes: the refused second process above, and the lock taken in
    # this process while that job holds it.
    out = tmp_path / "out.jsonl"
    with output_lock(out):
        with output_lock(out):
            assert lock_path(out).read_text().strip() == str(os.getpid())
        assert lock_path(out).exists()  # the inner block did not release it
    assert not lock_path(out).exists()
    with output_lock(out):  # free again
        pass
    assert issubclass(JobError, ValueError)
