"""What constrained rows cost a decode burst (SmolLM2, this CPU): one burst of the same rows
run by the program without constraints, and by the constrained program with one and with
all of them constrained, interleaved in one run.

One engine holds `--rows` requests (48 tokens of as many news articles each), all following
the regex `[a-z ]{1000}`: every token of such a run is masked, by the same allowed set at
every step, and the host's mask is the dearest kind (a counted repetition). Once they are
all decoding, each round's burst of `steps_per_sync` steps runs with the backend told that
none, one or all of its rows are constrained (which program runs, and which rows' masks the
host computes), in turn, `--repeats` times after a warm-up that compiles both programs.
Reported: the time per burst step, median and spread, and the paired median ratio to the
program without constraints. Prints a Markdown table (docs/ARCHITECTURE.md quotes it).

    .venv/bin/python benchmarks/constraint_cost.py [--rows 8] [--repeats 10]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import etjax
from etjax.bench.corpus import lee_articles
from etjax.engine.sequence import Status
from etjax.engine_build import RequestSettings, RuntimeOptions, build_engine

LONG = "[a-z ]{1000}"  # never complete within the run: every step is masked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    model = etjax.load_model()
    prompts = [model.tokenizer.encode(text)[:48] for text in lee_articles()[: args.rows]]
    options = RuntimeOptions(num_pages=1024)
    engine = build_engine(model.weights, model.config, model.tokenizer, options, num_pages=1024)
    settings = RequestSettings(max_new_tokens=900, regex=LONG)
    handles = [engine.submit(p, settings) for p in prompts]
    while any(h.sequence.status is not Status.RUNNING for h in handles):
        engine.step()
    backend, rows = engine.backend, [h.sequence.row for h in handles]
    modes = {"none": set(), "one": {rows[0]}, "all": set(rows)}
    times: dict[str, list[float]] = {name: [] for name in modes}
    for repeat in range(args.repeats + 2):  # the first two compile and warm up
        for name, constrained in modes.items():
            # Which rows the backend treats as constrained picks the program and the masks.
            backend._constrained = set(constrained)
            started = time.perf_counter()
            engine.step()
            if repeat >= 2:
                times[name].append((time.perf_counter() - started) / options.steps_per_sync)
    base = np.asarray(times["none"])
    lines = [
        f"| constrained rows of {args.rows} | ms per step (median) | spread | vs none |",
        "|---|---|---|---|",
    ]
    for name, values in times.items():
        v = np.asarray(values) * 1e3
        ratio = float(np.median(np.asarray(values) / base))
        lines.append(
            f"| {name} | {np.median(v):.1f} | {v.min():.1f}-{v.max():.1f} | {ratio:.3f}x |"
        )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
