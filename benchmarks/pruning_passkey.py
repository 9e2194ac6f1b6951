"""Passkey retrieval with entropic pruning vs dense attention (SmolLM2, greedy).

A five-digit number is hidden at a chosen depth of repetitive filler text (the passkey test of
Mohtashami & Jaggi, 2023); the prompt ends by asking for it and the model must produce it among
its first 16 greedy tokens. Contexts of 1K-8K tokens, depths 0-100% of the filler, several
keys per cell; every setting answers the same prompts. The prompt itself is prefilled densely
in every setting; pruning applies to every decode step, so the digits after the first are
read through the pruned attention. Writes the "pruning_passkey" section of docs/PERF.md.

    .venv/bin/python benchmarks/pruning_passkey.py [--lengths 1024,2048,4096,8192] [--keys 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.perf_report import machine_line, write_section
from benchmarks.pruning_settings import SETTINGS
from etjax.bench.passkey import DEPTHS, NEW_TOKENS, passkey_cases, run_passkey
from etjax.pruning.config import PruningConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,2048,4096,8192")
    parser.add_argument("--keys", type=int, default=2, help="keys per (length, depth)")
    parser.add_argument("--settings", default="default;fixed 12.5%", help="';'-separated")
    parser.add_argument("--verbose", action="store_true", help="print every answer")
    args = parser.parse_args()
    import etjax

    model = etjax.load_model()
    lengths = [int(x) for x in args.lengths.split(",")]
    cases = passkey_cases(lengths, args.keys)
    names = ["dense", *(s.strip() for s in args.settings.split(";"))]
    configs = {"dense": PruningConfig(), **{n: SETTINGS[n] for n in names[1:]}}
    found: dict[str, list[bool]] = {}
    kept: dict[str, float] = {}
    for name in names:
        started = time.perf_counter()
        result = run_passkey(model, cases, configs[name])
        found[name], kept[name] = result["found"], result["kept_fraction"]
        if args.verbose:
            for answer, case in zip(result["answers"], cases, strict=True):
                print(name, case, repr(answer))
        print(
            name, f"{np.mean(found[name]):.1%}", f"{time.perf_counter() - started:.0f}s", flush=True
        )
    raw = {
        "machine": machine_line(),
        "date": str(datetime.date.today()),
        "settings": {n: dataclasses.asdict(configs[n]) for n in names},
        "cases": [dataclasses.asdict(c) for c in cases],
        "found": found,
        "kept_fraction": kept,
    }
    lines = [
        "## Entropic attention pruning: passkey retrieval (SmolLM2)",
        "",
        f"Measured {raw['date']} on {raw['machine']}. Command: `.venv/bin/python "
        f"benchmarks/pruning_passkey.py --lengths {args.lengths} --keys {args.keys} "
        f"--settings '{args.settings}'`. "
        f"A five-digit key at depths {', '.join(f'{d:.0%}' for d in DEPTHS)} of filler, "
        f"{args.keys} keys per cell, prompt completed as plain text; correct when the key is "
        f"among the first {NEW_TOKENS} greedy tokens. Kept = average fraction of blocks read "
        "per decode step.",
        "",
        "| setting | " + " | ".join(f"{n // 1024}K" for n in lengths) + " | all | kept |",
        "|---|" + "---|" * (len(lengths) + 2),
    ]
    for name in names:
        per_length = [
            np.mean([f for f, c in zip(found[name], cases, strict=True) if c.length == n])
            for n in lengths
        ]
        lines.append(
            f"| {name} | "
            + " | ".join(f"{a:.0%}" for a in per_length)
            + f" | {np.mean(found[name]):.1%} | {kept[name]:.1%} |"
        )
    write_section("pruning_passkey", "\n".join(lines), raw)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
