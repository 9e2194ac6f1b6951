"""Batch jobs of 10^3 to 10^6 records: host time per round and peak memory.

The host side of `etjax batch` (etjax/jobs/batch.py and the engine's rounds) on the mock
device of tests/engine_mock.py, so that only the host's own cost is measured: the real
tokenizer and chat-free records, the real engine, scheduler, page allocator, results file
(fsynced each round) and summary; the device's part is the mock's hand-computed tokens. Each
size runs in a fresh process, which reports:

- rounds and host ms per round: the engine's own time (scheduling, collection; the mock's calls
  excluded) and the job's (everything in the run phase but the mock's calls: feeding the
  window, writing and syncing results, progress);
- the survey (first pass: ids, fingerprints, the page pool) and run wall times;
- the RSS before the job (imports and tokenizer) and the peak RSS during it, in MB: the peak
  (VmHWM) is reset right before the job (`/proc/self/clear_refs`), so setup's transient peaks
  do not hide the job's.

Targets (issue 14): host time per round flat within 2x from 10^3 to 10^6 records, and peak RSS
under 1 GB at 10^6. Writes the "batch-scale" section of docs/PERF.md; with `--prefix-words N`
every record starts with the same N-word instruction block (prefix caching shares its pages:
issue 30 asks that the host's time and memory stay as flat), the "batch-scale-shared" one.

    sysctl -w vm.max_map_count=1048576   # not needed: the mock compiles nothing
    .venv/bin/python benchmarks/batch_scale.py [--sizes 1000,10000,100000,1000000]
        [--prefix-words 400]
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CONFIG = """
[engine]
max_batch_size = 32
max_resident = 32
steps_per_sync = 8

[request]
max_new_tokens = 8
ignore_eos = true
"""
WORDS = ["river", "stone", "cloud", "lamp", "garden", "window", "letter", "train", "song"]


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"/proc/self/status has no {field}")


def _child(records: int, workdir: Path, prefix_words: int) -> dict:
    from etjax.engine.engine import Engine
    from etjax.engine.policies import make_policy
    from etjax.jobs.batch import run_batch
    from etjax.loaders.embedded import smollm2_gguf_path
    from etjax.loaders.gguf_weights import gguf_model_config, open_gguf
    from etjax.loaders.loaded_model import Model
    from etjax.run_config import load_run_config
    from etjax.tokenizer import Tokenizer
    from tests.engine_mock import MockBackend

    source = workdir / "in.jsonl"
    block = " ".join(WORDS[i * 5 % len(WORDS)] for i in range(prefix_words))
    with open(source, "w") as f:
        for i in range(records):
            prompt = f"{block}\n{WORDS[i % len(WORDS)]} {i}: tell me more".lstrip()
            f.write(json.dumps({"id": f"r{i}", "prompt": prompt}) + "\n")
    (workdir / "scale.toml").write_text(CONFIG)
    config = load_run_config(workdir / "scale.toml")
    reader = open_gguf(smollm2_gguf_path())
    cfg = gguf_model_config(reader, "float32")
    # The tokenizer and config of the embedded model; no weights: the mock is the device.
    model = Model(cfg, None, Tokenizer.from_gguf(reader), "smollm2 (no weights)", source)
    options = config.options
    engines: list[Engine] = []

    def make_engine(pages: int) -> Engine:
        backend = MockBackend(
            pages, options.steps_per_sync, options.page_size, vocab_size=cfg.vocab_size
        )
        backend.decode_log = collections.deque(maxlen=1)  # the mock's test log, not needed
        policy = make_policy(options.policy, 1000.0, 1.0, options.max_batch_size, 16)
        engines.append(Engine(backend, model.tokenizer, options, policy))
        return engines[-1]

    Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS to the current RSS
    before_mb = _status_mb("VmRSS")
    started = time.perf_counter()
    summary = run_batch(
        source, workdir / "out.jsonl", config, model, show_progress=False, make_engine=make_engine
    )
    total = time.perf_counter() - started
    engine = engines[0]
    run = summary["wall_seconds"]
    return {
        "records": records,
        "rounds": engine.round,
        "engine_host_ms_per_round": 1e3 * engine.host_seconds / engine.round,
        "job_host_ms_per_round": 1e3 * (run - engine.device_seconds) / engine.round,
        "mock_ms_per_round": 1e3 * engine.device_seconds / engine.round,
        "survey_s": total - run,
        "run_s": run,
        "generated_tokens": summary["generated_tokens"],
        "prefix_cache_hit_rate": summary["prefix_cache_hit_rate"],
        "rss_before_job_mb": before_mb,
        "peak_rss_mb": _status_mb("VmHWM"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000,100000,1000000")
    parser.add_argument("--prefix-words", type=int, default=0)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.workdir, args.prefix_words)))
        return
    from benchmarks.perf_report import machine_line, write_section

    rows = []
    for size in [int(s) for s in args.sizes.split(",")]:
        with tempfile.TemporaryDirectory() as workdir:
            command = [sys.executable, __file__, "--child", str(size), "--workdir", workdir]
            command += ["--prefix-words", str(args.prefix_words)]
            done = subprocess.run(command, check=True, capture_output=True, text=True)
            rows.append(json.loads(done.stdout.splitlines()[-1]))
            print(rows[-1], flush=True)
    base = rows[0]["job_host_ms_per_round"]
    lines = [
        "## `etjax batch`: host cost and memory as the job grows (mock device"
        + (", records sharing a first block)" if args.prefix_words else ")"),
        "",
        f"{machine_line()}; {datetime.date.today()}; `{shlex.join(sys.argv)}`",
        "",
        "Host side of `etjax batch` on the mock device (tests/engine_mock.py): real tokenizer, "
        "engine, scheduler, results file (fsynced per round) and summary; 32 resident rows, 8 "
        "new tokens per record, a fresh process per size. Host ms per round excludes the "
        "mock's calls; the job's includes feeding the window and writing results."
        + (
            f" Every record starts with one {args.prefix_words}-word block (prefix cache hit "
            f"rate: {', '.join(format(r['prefix_cache_hit_rate'], '.2f') for r in rows)})."
            if args.prefix_words
            else ""
        ),
        "",
        "| records | rounds | engine host ms/round | job host ms/round | vs 10^3 | survey s | "
        "run s | RSS before job MB | peak RSS MB |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['records']:,} | {r['rounds']:,} | {r['engine_host_ms_per_round']:.3f} | "
            f"{r['job_host_ms_per_round']:.3f} | {r['job_host_ms_per_round'] / base:.2f}x | "
            f"{r['survey_s']:.1f} | {r['run_s']:.1f} | {r['rss_before_job_mb']:.0f} | "
            f"{r['peak_rss_mb']:.0f} |"
        )
    name = "batch-scale-shared" if args.prefix_words else "batch-scale"
    write_section(name, "\n".join(lines), {"rows": rows})
    print("\n".join(lines))


if __name__ == "__main__":
    main()
