"""Prefix caching as users meet it: calls with shared beginnings through `etjax.decode()` and
`etjax batch`, with the cache on and off in the same run (SmolLM2-135M, float32, greedy).

- questions: Q questions after one D-token document (Lee articles), N new tokens each, one
  `decode()` call; time with the cache on against off;
- samples: `decode(prompt, n=8)` of a 2K-token prompt against `n=1`, with the cache on (and
  n=8 with it off);
- batch: an `etjax batch` job of R records sharing a 500-token instruction block: throughput
  with the cache on against off;
- host: the host's work for one admission and release of a 2K-token context (lookup, take,
  allocate, publish, release) with 10^4 idle cached pages against an empty cache.

Each figure is the median of the repetitions (first calls, which compile, excluded), the
variants interleaved. Writes the "prefix_cache" section of docs/PERF.md unless --no-write.

    .venv/bin/python benchmarks/prefix_cache.py [--repeats 3] [--questions 16]
        [--records 64] [--parts host,samples,questions,batch] [--no-write]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))

from benchmarks.perf_report import machine_line, median_spread, write_section

DOCUMENT_TOKENS, NEW_TOKENS, SAMPLE_PROMPT_TOKENS, BLOCK_TOKENS = 3000, 64, 2048, 500
PARTS = ("host", "samples", "questions", "batch")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--records", type=int, default=64)
    parser.add_argument(
        "--parts",
        default=",".join(PARTS),
        help="comma-separated, of " + ", ".join(PARTS) + "; with only some, the table is "
        "printed and PERF.md left as it is",
    )
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if unknown := sorted(set(parts) - set(PARTS)):
        parser.error(f"--parts: unknown {unknown}; allowed: {', '.join(PARTS)}")
    import etjax
    from etjax.bench.corpus import lee_articles

    model = etjax.load_model()
    text = "\n\n".join(lee_articles()[:40])
    ids = model.tokenizer.encode(text)
    raw = {"machine": machine_line(), "date": str(datetime.date.today())}
    runs = {
        "host": _host,
        "samples": lambda: _samples(model, ids, args.repeats),
        "questions": lambda: _questions(model, ids, args.questions, args.repeats),
        "batch": lambda: _batch(model, ids, args.records, args.repeats),
    }
    for part in parts:
        raw[part] = runs[part]()
        print(f"{part}:", raw[part], flush=True)
    markdown = _markdown(raw, args)
    if args.no_write or len(parts) < len(PARTS):
        print(markdown)
    else:
        write_section("prefix_cache", markdown, raw)


def _timed(calls: dict, repeats: int) -> dict[str, list[float]]:
    # Each call once to compile, then `repeats` interleaved rounds.
    for call in calls.values():
        call()
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            started = time.perf_counter()
            call()
            seconds[name].append(time.perf_counter() - started)
    return seconds


def _questions(model, ids: list[int], count: int, repeats: int) -> dict:
    import etjax

    document = model.tokenizer.decode(ids[:DOCUMENT_TOKENS])
    asks = [
        f"{document}\n\nQuestion {i + 1}: what does the text say?\nAnswer:" for i in range(count)
    ]

    def call(cache):
        return lambda: etjax.decode(
            asks, model=model, max_new_tokens=NEW_TOKENS, ignore_eos=True, prefix_cache=cache
        )

    seconds = _timed({"on": call(True), "off": call(False)}, repeats)
    cached = [r.cached_tokens for r in call(True)()]
    return {"seconds": seconds, "cached_tokens": cached, "questions": count}


def _samples(model, ids: list[int], repeats: int) -> dict:
    import etjax

    prompt = model.tokenizer.decode(ids[:SAMPLE_PROMPT_TOKENS])

    def call(n, cache):
        return lambda: etjax.decode(
            prompt,
            model=model,
            max_new_tokens=NEW_TOKENS,
            ignore_eos=True,
            temperature=0.8,
            seed=1,
            n=n,
            prefix_cache=cache,
        )

    calls = {"n1": call(1, True), "n8": call(8, True), "n8_off": call(8, False)}
    return {"seconds": _timed(calls, repeats)}


def _batch(model, ids: list[int], records: int, repeats: int) -> dict:
    from etjax.jobs.batch import run_batch
    from etjax.run_config import load_run_config

    block = model.tokenizer.decode(ids[4000 : 4000 + BLOCK_TOKENS])
    lines = [
        json.dumps({"id": i, "prompt": f"{block}\n\nRecord {i}: summarise item {i * 7 % 97}."})
        for i in range(records)
    ]
    work = Path(tempfile.mkdtemp(prefix="etjax_prefix_bench_"))
    source = work / "in.jsonl"
    source.write_text("\n".join(lines) + "\n")
    configs = {}
    for cache in ("on", "off"):
        path = work / f"{cache}.toml"
        path.write_text(
            "[engine]\nmax_batch_size = 32\nsteps_per_sync = 8\n"
            f"prefix_cache = {'true' if cache == 'on' else 'false'}\n\n"
            "[request]\nmax_new_tokens = 16\nignore_eos = true\n"
        )
        configs[cache] = load_run_config(path)
    runs = iter(range(10**6))

    def call(cache):
        def run():
            out = work / f"out_{cache}_{next(runs)}.jsonl"
            return run_batch(source, out, configs[cache], model, show_progress=False)

        return run

    summary = call("on")()
    seconds = _timed({"on": call("on"), "off": call("off")}, repeats)
    return {
        "seconds": seconds,
        "records": records,
        "hit_rate": summary["prefix_cache_hit_rate"],
        "generated_tokens": summary["generated_tokens"],
    }


def _host() -> dict:
    # One admission and release of a 2K-token context, against 10^4 idle cached pages or none.
    from etjax.cache.prefix_cache import PrefixCache

    page, cached_pages = 16, 10_000
    context = list(range(SAMPLE_PROMPT_TOKENS))

    def cycle(cache: PrefixCache) -> None:
        found = cache.lookup(context, (len(context) - 1) // page)
        cache.take(found.pages)
        pages = [e.page for e in found.pages] + cache.allocate(
            -(-len(context) // page) - len(found.pages)
        )
        held = cache.publish(found.pages, pages, context)
        cache.mark_written(held, len(context))
        cache.release(held, pages, context, len(context))

    def filled(count: int) -> PrefixCache:
        cache = PrefixCache(count + 2 * len(context) // page + 2, page)
        for i in range(count // 8):  # 8-page contexts of their own
            tokens = [10**6 + i] * (8 * page)
            pages = cache.allocate(8)
            held = cache.publish([], pages, tokens)
            cache.mark_written(held, len(tokens))
            cache.release(held, pages, tokens, len(tokens))
        return cache

    results = {}
    for name, count in (("empty", 0), ("full", cached_pages)):
        cache = filled(count)
        cycle(cache)
        times = []
        for _ in range(200):
            started = time.perf_counter()
            cycle(cache)
            times.append(time.perf_counter() - started)
        results[name] = {"us": statistics.median(times) * 1e6, "cached": cache.num_cached}
    return results


def _markdown(raw: dict, args) -> str:
    med = statistics.median
    lines = [
        "## Prefix caching: shared beginnings through `decode()` and `etjax batch` "
        "(SmolLM2-135M, float32)",
        "",
        f"{raw['machine']}, {raw['date']}. `benchmarks/prefix_cache.py --repeats "
        f"{args.repeats} --questions {args.questions} --records {args.records}`: seconds as "
        "median (min-max) "
        "of the repetitions, variants interleaved, first calls excluded.",
        "",
        "| what | cache on | cache off / reference | ratio | target |",
        "|---|---|---|---|---|",
    ]
    if q := raw.get("questions"):
        q_ratio = med(q["seconds"]["on"]) / med(q["seconds"]["off"])
        lines.append(
            f"| {q['questions']} questions on one {DOCUMENT_TOKENS}-token document, "
            f"{NEW_TOKENS} new tokens each, one `decode()` | {median_spread(q['seconds']['on'])} "
            f"s | {median_spread(q['seconds']['off'])} s (off) | {q_ratio:.2f}x the time | "
            "<= 0.25x |"
        )
    if "samples" in raw:
        s = raw["samples"]["seconds"]
        lines.append(
            f"| `decode(prompt, n=8)`, {SAMPLE_PROMPT_TOKENS}-token prompt, {NEW_TOKENS} new "
            f"tokens | {median_spread(s['n8'])} s | {median_spread(s['n1'])} s (n=1); "
            f"{median_spread(s['n8_off'])} s (n=8, off) | {med(s['n8']) / med(s['n1']):.2f}x "
            "the n=1 time | <= 1.5x |"
        )
    if b := raw.get("batch"):
        b_ratio = med(b["seconds"]["off"]) / med(b["seconds"]["on"])
        lines.append(
            f"| `etjax batch`, {b['records']} records after one {BLOCK_TOKENS}-token block, "
            f"16 new tokens each | {median_spread(b['seconds']['on'])} s | "
            f"{median_spread(b['seconds']['off'])} s (off) | {b_ratio:.2f}x the throughput "
            f"(hit rate {b['hit_rate']:.2f}) | >= 2x |"
        )
    if h := raw.get("host"):
        lines.append(
            f"| host: admit and release a {SAMPLE_PROMPT_TOKENS}-token context | "
            f"{h['full']['us']:.0f} us with {h['full']['cached']} pages cached | "
            f"{h['empty']['us']:.0f} us, empty | {h['full']['us'] / h['empty']['us']:.2f}x | "
            "<= 1.2x |"
        )
    if q:
        lines += ["", f"Cached prompt tokens per question (cache on): {q['cached_tokens']}."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
