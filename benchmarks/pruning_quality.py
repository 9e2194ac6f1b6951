"""Quality against kept fraction: teacher-forced perplexity of long documents, pruned vs dense.

Documents are consecutive Lee-corpus articles joined until they reach each context length. The
prefix is prefilled densely, once per length (all documents as one batch); then, for every
pruning setting, the last 512 tokens are fed one at a time through the decode path from a copy
of that cache, each forward pass reading the blocks its budget keeps (the budget of a token
comes from the distribution that predicted it, as in generation), and the negative
log-likelihood of each next true token is accumulated.

The settings span the curve rather than one tuned point: fixed fractions (entropy-blind
controls), entropy ramps, per-head vs shared selection, and the remembered-mass ranking.
Reports, per setting and length, the perplexity ratio pruned / dense (mean and worst document)
and the average fraction of blocks read. Writes one "pruning_quality_<length>" section of
docs/PERF.md per length.

    .venv/bin/python benchmarks/pruning_quality.py [--docs 4] [--lengths 4096,8192]
        [--model gemma3-270m]

On a model with sliding-window layers (Gemma 3) only the global layers prune (a local layer
reads its window whole); "reads" is then the fraction of every layer's key reads against the
dense model's, and the sections are "pruning_quality_<model>_<length>".
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import shlex
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.perf_report import machine_line, write_section
from benchmarks.pruning_settings import SETTINGS
from etjax.bench.perplexity import EVAL_TOKENS, long_documents, perplexity, prefill_documents
from etjax.pruning.config import PruningConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=4)
    parser.add_argument("--lengths", default="4096,8192")
    parser.add_argument(
        "--settings", default=";".join(n for n in SETTINGS if n != "default"), help="';'-separated"
    )
    parser.add_argument(
        "--part", default="", help="suffix of the PERF.md section, to keep several runs"
    )
    parser.add_argument("--model", default=None, help="a model name (default: SmolLM2)")
    args = parser.parse_args()

    import etjax
    from etjax.bench.corpus import lee_articles

    model = etjax.load_model(args.model, dtype="float32")
    articles = lee_articles()
    chosen = [s.strip() for s in args.settings.split(";")]
    for length in (int(x) for x in args.lengths.split(",")):
        prefilled = prefill_documents(
            model, long_documents(model.tokenizer, articles, args.docs, length)
        )
        dense = perplexity(model, prefilled, PruningConfig())
        results = {"dense": dense}
        print(length, "dense", dense, flush=True)
        for name in chosen:
            row = perplexity(model, prefilled, SETTINGS[name])
            row["ratio"] = (np.array(row["ppl"]) / np.array(dense["ppl"])).tolist()
            results[name] = row
            print(length, name, row, flush=True)
        _report(length, results, chosen, args.docs, args.part, args.model)


def _report(
    length: int, results: dict, chosen: list[str], num_docs: int, part: str, model: str | None
) -> None:
    raw = {
        "machine": machine_line(),
        "date": str(datetime.date.today()),
        "settings": {n: dataclasses.asdict(SETTINGS[n]) for n in chosen},
        "results": results,
    }
    dense = ", ".join(f"{p:.2f}" for p in results["dense"]["ppl"])
    lines = [
        f"## Entropic attention pruning: quality against kept fraction, {length} tokens "
        f"({model or 'SmolLM2'}){', part ' + part if part else ''}",
        "",
        f"Measured {raw['date']} on {raw['machine']}. Command: `.venv/bin/python "
        f"benchmarks/pruning_quality.py {shlex.join(sys.argv[1:])}`. Teacher-forced perplexity "
        f"of the last {EVAL_TOKENS} tokens of {num_docs} documents (Lee articles joined to "
        f"{length} tokens; dense perplexities {dense}) through the decode path, pruned over "
        "dense; kept = average fraction of the pruned layers' blocks read, reads = of all "
        "layers' key reads against the dense model's (they differ where sliding-window layers, "
        "never pruned, read their windows). Unless named, settings share the "
        "selection across KV heads, rank by the key bound only and follow the exact entropy.",
        "",
        "| setting | ppl ratio, mean | worst document | kept | reads |",
        "|---|---|---|---|---|",
    ]
    for name in chosen:
        r = results[name]
        lines.append(
            f"| {name} | {np.mean(r['ratio']):.4f} | {max(r['ratio']):.4f} | "
            f"{r['kept_fraction']:.1%} | {r['read_fraction']:.1%} |"
        )
    prefix = "pruning_quality" if model is None else f"pruning_quality_{model}"
    write_section(f"{prefix}_{length}{part}", "\n".join(lines), raw)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
