"""16-bit KV caches (float16, bfloat16) against float32 (SmolLM2-135M, float32 weights): what
they cost in quality and save in memory and time, side by side in one run.

- perplexity: teacher-forced perplexity of the last 512 tokens of D long documents
  (etjax/bench/perplexity.py), caches of each dtype prefilled from the same tokens
  (`--pruned`: also with pruning at its defaults; slow on a CPU, as bfloat16 pages are);
- fidelity: P greedy `decode()` continuations of Lee articles' openings, N new tokens: how
  many are identical to the float32 cache's, and the mean number of tokens before the first
  difference;
- time: one `decode()` of B questions after a shared C-token document (the prefix cache
  prefills it once), 65 new tokens against 1: the warm decode step is the difference over 64
  steps; the dtypes interleaved, first calls excluded;
- memory: KV bytes per token of context, from the cache's own arithmetic.

Writes the "kv_dtype" section of docs/PERF.md unless --no-write.

    .venv/bin/python benchmarks/kv_dtype.py [--documents 2] [--length 1024] [--pruned]
        [--prompts 4] [--new 64] [--context 1024] [--batch 4] [--repeats 2] [--no-write]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))

from benchmarks.perf_report import machine_line, median_spread, write_section

DTYPES = ("float32", "float16", "bfloat16")
STEPS = 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=2)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--pruned", action="store_true")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    import etjax
    from etjax.bench.corpus import lee_articles
    from etjax.cache.kv_cache import kv_cache_bytes

    model = etjax.load_model()
    articles = lee_articles()
    raw = {"machine": machine_line(), "date": str(datetime.date.today()), "args": vars(args)}
    raw["bytes_per_token"] = {d: kv_cache_bytes(model.config, 1, 1, d) for d in DTYPES}
    raw["perplexity"] = _perplexity(model, articles, args.documents, args.length, args.pruned)
    print("perplexity:", raw["perplexity"], flush=True)
    raw["fidelity"] = _fidelity(model, articles, args.prompts, args.new)
    print("fidelity:", raw["fidelity"], flush=True)
    raw["time"] = _step_time(model, articles, args.context, args.batch, args.repeats)
    print("time:", raw["time"], flush=True)
    if not args.no_write:
        write_section("kv_dtype", _markdown(raw), raw)


def _perplexity(model, articles: list[str], count: int, length: int, pruned: bool) -> dict:
    from etjax.bench.perplexity import long_documents, perplexity, prefill_documents
    from etjax.pruning.config import PruningConfig

    docs = long_documents(model.tokenizer, articles, count, length)
    out = {}
    for dtype in DTYPES:
        prefilled = prefill_documents(model, docs, dtype)
        settings = [("dense", PruningConfig())] + [("pruned", PruningConfig(True))] * pruned
        for name, pruning in settings:
            started = time.perf_counter()
            result = perplexity(model, prefilled, pruning)
            out[f"{dtype}_{name}"] = {
                "ppl": statistics.fmean(result["ppl"]),
                "kept_fraction": result["kept_fraction"],
                "seconds": time.perf_counter() - started,  # compile included
            }
    return out


def _fidelity(model, articles: list[str], count: int, new: int) -> dict:
    import etjax

    prompts = [" ".join(a.split()[:120]) for a in articles[200 : 200 + count]]
    outs = {
        d: etjax.decode(prompts, model=model, max_new_tokens=new, ignore_eos=True, kv_dtype=d)
        for d in DTYPES
    }
    result: dict = {"prompts": count, "new": new}
    for d in DTYPES:
        same_prefix = []
        for a, b in zip(outs["float32"], outs[d], strict=True):
            pairs = enumerate(zip(a.token_ids, b.token_ids, strict=True))
            same_prefix.append(next((i for i, (x, y) in pairs if x != y), new))
        result[d] = {"identical": sum(n == new for n in same_prefix), "same_prefix": same_prefix}
    return result


def _step_time(model, articles: list[str], context: int, batch: int, repeats: int) -> dict:
    import etjax

    ids: list[int] = []
    i = 0
    while len(ids) < context:
        ids += model.tokenizer.encode(articles[i] + "\n\n")
        i += 1
    document = model.tokenizer.decode(ids[:context])
    prompts = [f"{document}\n\nQuestion {q}: what happened next?" for q in range(batch)]

    def call(dtype: str, new: int):
        return lambda: etjax.decode(
            prompts, model=model, max_new_tokens=new, ignore_eos=True, kv_dtype=dtype
        )

    calls = {(d, n): call(d, n) for d in DTYPES for n in (1, STEPS + 1)}
    for run in calls.values():  # compile
        run()
    seconds = {key: [] for key in calls}
    for _ in range(repeats):
        for key, run in calls.items():
            started = time.perf_counter()
            run()
            seconds[key].append(time.perf_counter() - started)
    return {
        d: {
            "step_ms": [
                (long - short) / STEPS * 1e3
                for long, short in zip(seconds[(d, STEPS + 1)], seconds[(d, 1)], strict=True)
            ],
            "call_s": seconds[(d, STEPS + 1)],
        }
        for d in DTYPES
    }


def _markdown(raw: dict) -> str:
    a, p, f, t = raw["args"], raw["perplexity"], raw["fidelity"], raw["time"]
    med = statistics.median
    lines = [
        "## 16-bit KV caches against float32 (SmolLM2-135M, float32 weights)",
        "",
        f"{raw['machine']}, {raw['date']}. `benchmarks/kv_dtype.py --documents "
        f"{a['documents']} --length {a['length']}{' --pruned' * a['pruned']} --prompts "
        f"{a['prompts']} --new {a['new']} --context {a['context']} --batch {a['batch']} "
        f"--repeats {a['repeats']}`. Ratios against the float32 cache of the same run.",
        "",
        "| what | " + " | ".join(f"{d} cache" for d in DTYPES) + " |",
        "|---|" + "---|" * len(DTYPES),
    ]

    def row(what: str, cells: list[str]) -> None:
        lines.append(f"| {what} | " + " | ".join(cells) + " |")

    base = raw["bytes_per_token"]["float32"]
    row(
        "KV bytes per token of context",
        [
            f"{raw['bytes_per_token'][d]:,} ({raw['bytes_per_token'][d] / base:.2f}x)"
            for d in DTYPES
        ],
    )
    for name in ("dense", "pruned") if a["pruned"] else ("dense",):
        lo = p[f"float32_{name}"]["ppl"]
        row(
            f"perplexity, last 512 tokens of {a['documents']} x {a['length']}, {name}",
            [
                f"{p[f'{d}_{name}']['ppl']:.4f} ({p[f'{d}_{name}']['ppl'] / lo:.4f}x)"
                for d in DTYPES
            ],
        )
    row(
        f"greedy continuations identical to float32's ({f['prompts']} prompts, {f['new']} "
        "tokens); mean first difference",
        [
            f"{f[d]['identical']} of {f['prompts']}; "
            f"token {statistics.fmean(f[d]['same_prefix']):.0f}"
            for d in DTYPES
        ],
    )
    step = {d: med(t[d]["step_ms"]) for d in DTYPES}
    row(
        f"warm decode step, batch {a['batch']} at {a['context']} tokens of context, ms "
        "(`decode()`, 65 vs 1 new tokens)",
        [f"{median_spread(t[d]['step_ms'])} ({step[d] / step['float32']:.2f}x)" for d in DTYPES],
    )
    first = p["float32_dense"]["seconds"]
    row(
        "teacher-forced perplexity run, 512 steps, dense, s (compile included)",
        [
            f"{p[f'{d}_dense']['seconds']:.0f} ({p[f'{d}_dense']['seconds'] / first:.1f}x)"
            for d in DTYPES
        ],
    )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
