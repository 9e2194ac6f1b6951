"""Pruned rows that share a document, grouped against one by one (SmolLM2, this CPU).

The `long` workload asks four questions of each document; with the prefix cache the four rows
hold the document's pages in common. Pruned one row at a time, each row selects and reads its
own blocks of the document; grouped (etjax/pruning/groups.py), the rows select the document's
blocks together and the C++ kernel reads them once. This prefills the `long` workload's rows
under the config's pruning and times, interleaved and repeated after two warm-up calls of
each (so nothing compiled is timed), one decode burst of every row:

- grouped (`group_shared_prefixes` on);
- one by one (the same engine with grouping turned off, the default);
- dense (pruning off, the same rows in a second engine: cascade attention reads the shared
  document once).

Reports medians and spreads per burst step, paired median ratios, and the blocks each token
attended and read (the group's read once) per layer and KV head. Writes the "pruned_groups"
section of docs/PERF.md.

    .venv/bin/python benchmarks/pruned_groups.py [--rows 8] [--repeats 7]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import shlex
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.perf_report import machine_line, write_section
from etjax.attention import AttentionBackend
from etjax.bench.measure import request_settings
from etjax.bench.workloads import long
from etjax.engine.sequence import Status
from etjax.engine_build import build_engine, workload_pages
from etjax.pruning.config import PruningConfig
from etjax.run_config import load_run_config

KINDS = ("grouped", "one by one", "dense")


@contextlib.contextmanager
def grouping(on: bool):
    """Whether the engine groups pruned rows (the backend's switch, turned for a call)."""
    original = AttentionBackend.reads_grouped_pruned_rows
    if not on:
        AttentionBackend.reads_grouped_pruned_rows = property(lambda _: False)
    try:
        yield
    finally:
        AttentionBackend.reads_grouped_pruned_rows = original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8, help="rows (four on each document)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--config", default="pruning_only", help="a config with pruning")
    parser.add_argument(
        "--context", type=int, default=None, help="context the documents fit (default: model's)"
    )
    args = parser.parse_args()
    import etjax
    from etjax.bench.corpus import lee_articles

    config = load_run_config(args.config)
    model = etjax.load_model(config.model.name)
    # The documents fit the context, as in `etjax bench`.
    context = args.context or model.config.max_position_embeddings
    workload = long(model.tokenizer, lee_articles(), args.rows, 0, context)
    # No eos: the rows stay resident through every timed call (their 256-1,024 new tokens
    # outlast the bursts timed).
    settings = [
        dataclasses.replace(s, ignore_eos=True) for s in request_settings(config, workload, False)
    ]
    prompts = [model.tokenizer.encode(r.prompt) for r in workload]
    options = config.options
    grouping_on = dataclasses.replace(options.pruning, group_shared_prefixes=True)
    pruned = _prefilled(model, dataclasses.replace(options, pruning=grouping_on), prompts, settings)
    print("prefilled (pruned):", [len(p) for p in prompts], flush=True)
    dense_options = dataclasses.replace(options, pruning=PruningConfig())
    dense = _prefilled(model, dense_options, prompts, settings)
    print("prefilled (dense)", flush=True)

    calls = {
        "grouped": lambda: _burst(*pruned, grouped=True),
        "one by one": lambda: _burst(*pruned, grouped=False),
        "dense": lambda: _burst(*dense, grouped=False),
    }
    for call in calls.values():  # warm-up: compiles
        call(), call()
    seconds = {kind: [] for kind in KINDS}
    blocks = {kind: [] for kind in KINDS}
    for _ in range(args.repeats):
        for kind, call in calls.items():
            elapsed, attended, read = call()
            seconds[kind].append(elapsed)
            blocks[kind].append((attended, read))
        print({k: round(1000 * v[-1], 1) for k, v in seconds.items()}, flush=True)
    lengths = [s.length for s in sorted(pruned[0].live, key=lambda s: s.row)]
    _report(seconds, blocks, lengths, args)


def _prefilled(model, options, prompts, settings):
    pages = workload_pages(prompts, settings, options)
    engine = build_engine(model.weights, model.config, model.tokenizer, options, pages)
    for prompt, s in zip(prompts, settings, strict=True):
        engine.submit(prompt, s)
    while any(s.status is not Status.RUNNING for s in engine.live):
        engine.step()
    return engine, options.steps_per_sync


def _burst(engine, steps: int, grouped: bool) -> tuple[float, float, float]:
    # One burst of every row: seconds per step, and the blocks per token (per layer and KV
    # head) attended and read, averaged over the burst's tokens.
    batch = sorted(engine.live, key=lambda s: s.row)
    before = [len(s.output.kept_blocks) for s in batch]
    with grouping(grouped):
        engine._reserve_burst_pages(batch, batch)
        elapsed = engine._decode_burst(batch)
    kept = np.concatenate([s.output.kept_blocks[b:] for s, b in zip(batch, before, strict=True)])
    spared = np.concatenate(
        [s.output.shared_blocks[b:] for s, b in zip(batch, before, strict=True)]
    )
    return elapsed / steps, float(np.mean(kept)), float(np.mean(kept - spared))


def _report(seconds: dict, blocks: dict, lengths: list[int], args) -> None:
    base = np.asarray(seconds["one by one"])
    lines = [
        "## Pruned rows sharing a document: grouped against one by one (SmolLM2, `long`)",
        "",
        f"Measured {datetime.date.today()} on {machine_line()}. Command: `.venv/bin/python "
        f"benchmarks/pruned_groups.py {shlex.join(sys.argv[1:])}`. {len(lengths)} rows of "
        f"the `long` workload (four questions on each document; contexts {min(lengths)}-"
        f"{max(lengths)} tokens at the start), prefilled under `{args.config}`'s pruning; "
        f"then {args.repeats} interleaved repetitions of one decode burst of every row in "
        "each variant, after two warm-up calls. Seconds per burst step; ratios are paired "
        "medians against one by one. Blocks per token are per layer and KV head, averaged "
        "over the bursts' tokens: attended, and read (the group's counted once for it).",
        "",
        "| variant | median ms/step | spread | vs one by one | blocks attended | blocks read |",
        "|---|---|---|---|---|---|",
    ]
    for kind in KINDS:
        s = np.asarray(seconds[kind])
        attended = np.mean([a for a, _ in blocks[kind]])
        read = np.mean([r for _, r in blocks[kind]])
        lines.append(
            f"| {kind} | {1000 * np.median(s):.1f} | {1000 * s.min():.1f}-{1000 * s.max():.1f}"
            f" | {np.median(s / base):.2f}x | {attended:.1f} | {read:.1f} |"
        )
    raw = {
        "machine": machine_line(),
        "date": str(datetime.date.today()),
        "lengths": lengths,
        "seconds": seconds,
        "blocks": blocks,
    }
    write_section("pruned_groups", "\n".join(lines), raw)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
