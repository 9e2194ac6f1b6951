"""What constrained rows cost a decode burst (SmolLM2, this CPU): the step time of a batch
of rows with none, one and all of them constrained, side by side in one run.

Each configuration runs the same prompts (48 tokens of each of `--rows` news articles) for
`--tokens` new tokens per row through one engine, interleaved and repeated after a warm-up
run of each (no compilation timed). Unconstrained rows ignore eos; a constrained row follows
a regex longer than the run (`[a-z ]{1000}`), so it too runs every step and ends by length,
and its mask is never trivial. Reported: the time per step of the decode bursts (prefill
left out), median and spread over the repeats, and the paired median ratio to the
unconstrained batch. Prints a Markdown table (docs/ARCHITECTURE.md quotes it).

    .venv/bin/python benchmarks/constraint_cost.py [--rows 8] [--tokens 48] [--repeats 3]
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
from etjax.engine.build import RequestSettings, RuntimeOptions, build_engine

LONG = "[a-z ]{1000}"  # never complete within the run: every step is masked


def _settings(constrained: bool, tokens: int) -> RequestSettings:
    if constrained:
        return RequestSettings(max_new_tokens=tokens, regex=LONG)
    return RequestSettings(max_new_tokens=tokens, ignore_eos=True)


def run(model, prompts, flags: list[bool], tokens: int) -> float:
    """Seconds per step of the decode bursts (prefill left out) of one run with row i
    constrained where flags[i]."""
    options = RuntimeOptions(num_pages=512)
    engine = build_engine(model.weights, model.config, model.tokenizer, options, num_pages=512)
    bursts, spent, decode = [0], [0.0], engine.backend.decode

    def timed(*args, **kwargs):
        started = time.perf_counter()
        result = decode(*args, **kwargs)
        spent[0] += time.perf_counter() - started
        bursts[0] += 1
        return result

    engine.backend.decode = timed
    engine.generate(prompts, [_settings(f, tokens) for f in flags])
    return spent[0] / (bursts[0] * options.steps_per_sync)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model = etjax.load_model()
    # The first 48 tokens of as many news articles (the Lee corpus, in gensim).
    prompts = [model.tokenizer.encode(text)[:48] for text in lee_articles()[: args.rows]]
    configs = {
        "none": [False] * args.rows,
        "one": [True] + [False] * (args.rows - 1),
        "all": [True] * args.rows,
    }
    for flags in configs.values():  # warm-up: compile every program
        run(model, prompts, flags, args.tokens)
    times = {name: [] for name in configs}
    for _ in range(args.repeats):
        for name, flags in configs.items():
            times[name].append(run(model, prompts, flags, args.tokens))
            print(f"{name}: {times[name][-1] * 1e3:.1f} ms per step")
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
