"""A first `decode()` in a fresh process: cold, and with the persistent compilation cache warm.

Each pair runs two fresh processes on one new, empty cache directory (ETJAX_COMPILATION_CACHE):
the first compiles and fills it, the second finds its programs there. Each process loads the
embedded SmolLM2-135M-Instruct (float32) and calls `etjax.decode` once on one prompt, 64 new
tokens, greedy; it reports the load time, the decode call's wall time and the seconds JAX spent
compiling (its own monitoring events), and the whole process's wall time is taken from outside.
Writes the "warm-start" section of docs/PERF.md.

    .venv/bin/python benchmarks/warm_start.py [--pairs 3]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CHILD = """
import json, time
import jax
compile_s = [0.0]
def note(event, duration, **kwargs):
    if event == "/jax/compilation_cache/compile_requests_use_cache" or "backend_compile" in event:
        compile_s[0] += duration
jax.monitoring.register_event_duration_secs_listener(note)
import etjax
started = time.perf_counter()
model = etjax.load_model()
loaded = time.perf_counter()
(result,) = etjax.decode("Explain entropy to a child.", model=model, max_new_tokens=64,
                         ignore_eos=True)
done = time.perf_counter()
print(json.dumps({"load_s": loaded - started, "decode_s": done - loaded,
                  "compile_s": compile_s[0], "tokens": len(result.token_ids)}))
"""


def _process(cache: Path) -> dict:
    env = dict(os.environ, ETJAX_COMPILATION_CACHE=str(cache), JAX_PLATFORMS="cpu")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, check=True, capture_output=True, text=True
    )
    row = json.loads(done.stdout.splitlines()[-1])
    row["process_s"] = time.perf_counter() - started
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    args = parser.parse_args()
    from benchmarks.perf_report import machine_line, median_spread, write_section

    runs: dict[str, list[dict]] = {"cold": [], "warm": []}
    for _ in range(args.pairs):
        with tempfile.TemporaryDirectory() as cache:
            for kind in ("cold", "warm"):
                runs[kind].append(_process(Path(cache)))
                print(kind, runs[kind][-1], flush=True)
    lines = [
        "## Warm start: a fresh process with an empty and a filled compilation cache",
        "",
        f"{machine_line()}; {datetime.date.today()}; `{shlex.join(sys.argv)}`",
        "",
        "A fresh process: load the embedded SmolLM2-135M-Instruct (float32), one `decode()` of "
        "64 new tokens; cold (empty cache) and warm (the cache the cold process filled), "
        f"{args.pairs} pairs, median (min-max) in seconds.",
        "",
        "| cache | whole process | load | first decode() | of which compiling |",
        "|---|---|---|---|---|",
    ]
    for kind, rows in runs.items():
        cell = lambda key, rows=rows: median_spread([r[key] for r in rows])  # noqa: E731
        lines.append(
            f"| {kind} | {cell('process_s')} | {cell('load_s')} | {cell('decode_s')} | "
            f"{cell('compile_s')} |"
        )
    write_section("warm-start", "\n".join(lines), runs)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
