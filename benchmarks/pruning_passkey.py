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
import random
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.perf_report import machine_line, write_section
from benchmarks.pruning_settings import SETTINGS
from etjax.pruning.config import PruningConfig

INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it.\n"
)
FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
QUESTION = "\nWhat is the pass key? The pass key is"
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
NEW_TOKENS = 16


def passkey_prompt(tokenizer, target_tokens: int, depth: float, key: int) -> str:
    """A prompt of about `target_tokens` tokens with the key at `depth` of the filler."""
    needle = f"The pass key is {key}. Remember it. {key} is the pass key.\n"
    fixed = len(tokenizer.encode(INTRO + needle + QUESTION))
    per_filler = len(tokenizer.encode(FILLER * 10)) / 10
    repeats = max(int((target_tokens - fixed) / per_filler), 1)
    before = round(repeats * depth)
    return INTRO + FILLER * before + needle + FILLER * (repeats - before) + QUESTION


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,2048,4096,8192")
    parser.add_argument("--keys", type=int, default=2, help="keys per (length, depth)")
    parser.add_argument("--settings", default="default;fixed 12.5%", help="';'-separated")
    parser.add_argument("--verbose", action="store_true", help="print every answer")
    args = parser.parse_args()
    import etjax

    model = etjax.load_model()
    rng = random.Random(0)
    lengths = [int(x) for x in args.lengths.split(",")]
    cases = [
        (n, d, rng.randrange(10_000, 100_000))
        for n in lengths
        for d in DEPTHS
        for _ in range(args.keys)
    ]
    prompts = [passkey_prompt(model.tokenizer, n, d, k) for n, d, k in cases]
    names = ["dense", *(s.strip() for s in args.settings.split(";"))]
    configs = {"dense": PruningConfig(), **{n: SETTINGS[n] for n in names[1:]}}
    found: dict[str, list[bool]] = {}
    kept: dict[str, float] = {}
    for name in names:
        started = time.perf_counter()
        results = etjax.decode(
            prompts,
            model=model,
            max_new_tokens=NEW_TOKENS,
            max_batch_size=8,
            pruning=configs[name],
        )
        found[name] = [str(k) in r.text for r, (_, _, k) in zip(results, cases, strict=True)]
        if args.verbose:
            for r, case in zip(results, cases, strict=True):
                print(name, case, len(r.prompt_token_ids), repr(r.text))
        kept[name] = float(
            np.mean(
                [
                    kb / -(-(len(r.prompt_token_ids) + i + 1) // 16)
                    for r in results
                    for i, kb in enumerate(r.kept_blocks[:-1])
                ]
            )
        )
        print(
            name, f"{np.mean(found[name]):.1%}", f"{time.perf_counter() - started:.0f}s", flush=True
        )
    raw = {
        "machine": machine_line(),
        "date": str(datetime.date.today()),
        "settings": {n: dataclasses.asdict(configs[n]) for n in names},
        "cases": [dict(length=n, depth=d, key=k) for n, d, k in cases],
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
            np.mean([f for f, c in zip(found[name], cases, strict=True) if c[0] == n])
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
