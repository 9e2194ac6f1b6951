"""Greedy fidelity of entropic pruning: ROUGE-L of pruned continuations against dense ones.

50 prompts from the Lee corpus, each three consecutive articles (about 0.4K-1.5K tokens),
continued greedily for 64 tokens with dense attention and with each pruning setting; the
score of a prompt is ROUGE-L F1 of its pruned continuation against its dense one (1.0 =
identical words). Writes the "pruning_fidelity" section of docs/PERF.md.

    .venv/bin/python benchmarks/pruning_fidelity.py [--prompts 50] [--settings "default"]
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
from etjax.bench.text_metrics import rouge_l
from etjax.pruning.config import PruningConfig

NEW_TOKENS = 64
PAGE = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--settings", default="default;fixed 12.5%", help="';'-separated")
    args = parser.parse_args()
    import etjax
    from etjax.bench.corpus import lee_articles

    model = etjax.load_model()
    articles = lee_articles()
    prompts = [
        "\n\n".join(articles[(5 * i + j) % len(articles)] for j in range(3)) + "\n\n"
        for i in range(args.prompts)
    ]
    names = ["dense", *(s.strip() for s in args.settings.split(";"))]
    configs = {"dense": PruningConfig(), **{n: SETTINGS[n] for n in names[1:]}}
    texts: dict[str, list[str]] = {}
    kept: dict[str, float] = {}
    prompt_tokens: list[int] = []
    for name in names:
        started = time.perf_counter()
        results = etjax.decode(
            prompts, model=model, max_new_tokens=NEW_TOKENS, ignore_eos=True, pruning=configs[name]
        )
        texts[name] = [r.text for r in results]
        prompt_tokens = [len(r.prompt_token_ids) for r in results]
        kept[name] = float(
            np.mean(
                [
                    kb / -(-(len(r.prompt_token_ids) + i + 1) // PAGE)
                    for r in results
                    for i, kb in enumerate(r.kept_blocks[:-1])
                ]
            )
        )
        print(name, f"{time.perf_counter() - started:.0f}s", flush=True)
    scores = {n: rouge_l(texts[n], texts["dense"]) for n in names[1:]}
    raw = {
        "machine": machine_line(),
        "date": str(datetime.date.today()),
        "settings": {n: dataclasses.asdict(configs[n]) for n in names},
        "prompt_tokens": prompt_tokens,
        "texts": texts,
        "rouge_l": scores,
        "kept_fraction": kept,
    }
    lines = [
        "## Entropic attention pruning: greedy fidelity to dense outputs (SmolLM2)",
        "",
        f"Measured {raw['date']} on {raw['machine']}. Command: `.venv/bin/python "
        f"benchmarks/pruning_fidelity.py --prompts {args.prompts} --settings '{args.settings}'`. "
        f"{args.prompts} prompts of "
        f"three Lee articles ({min(prompt_tokens)}-{max(prompt_tokens)} tokens), "
        f"{NEW_TOKENS} greedy tokens; ROUGE-L F1 of each pruned continuation against the dense "
        "one (`rouge-score`). Kept = average fraction of blocks read per decode step.",
        "",
        "| setting | ROUGE-L mean | median | min | identical | kept |",
        "|---|---|---|---|---|---|",
    ]
    for name in names[1:]:
        s = np.array(scores[name])
        same = np.mean([a == b for a, b in zip(texts[name], texts["dense"], strict=True)])
        lines.append(
            f"| {name} | {s.mean():.3f} | {np.median(s):.3f} | {s.min():.3f} | {same:.0%} | "
            f"{kept[name]:.1%} |"
        )
    write_section("pruning_fidelity", "\n".join(lines), raw)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
