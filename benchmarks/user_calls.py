"""`etjax.decode()` as a notebook user meets it, against transformers, on SmolLM2-135M float32.

Three measurements, each through the public API (`etjax.load_model`, `etjax.decode`):

- the first call of a fresh process (a subprocess, no persistent compilation cache): wall
  time, XLA compilations and compile seconds (counted with `jax.monitoring`);
- a warm call on the same 8 prompts (Lee articles cut to 60 tokens, 64 new tokens, greedy):
  throughput against transformers `generate` on the same batch, repetitions interleaved, and
  the share of the call the engine spends on the host (scheduling, row setup, collection);
- the prefill of one 4K-token document (`decode(doc, max_new_tokens=1)`) against
  transformers' forward pass over the same ids.

Runs against whatever `etjax` is importable, so `PYTHONPATH=<older checkout>` measures an
older tree with the same script. Writes the "user_calls" section of docs/PERF.md unless
`--no-write`.

    .venv/bin/python benchmarks/user_calls.py [--repeats 5] [--no-write]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

# Appended, not inserted first: a PYTHONPATH naming an older checkout must win, or the
# script would measure this tree whatever the caller asked for.
sys.path.append(str(Path(__file__).resolve().parent.parent))

from benchmarks.perf_report import machine_line, median_spread, write_section

PROMPTS, PROMPT_TOKENS, NEW_TOKENS, DOCUMENT_TOKENS = 8, 60, 64, 4096
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--first-call", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.first_call:
        print(json.dumps(_first_call()))
        return
    raw = {"machine": machine_line(), "date": str(datetime.date.today()), "repeats": args.repeats}
    raw["first_call"] = _first_call_in_fresh_process()
    print("first call:", raw["first_call"], flush=True)
    raw["warm_calls"] = _warm_calls(args.repeats)
    print("warm calls:", {k: v for k, v in raw["warm_calls"].items() if k != "texts"}, flush=True)
    raw["prefill"] = _prefill(args.repeats)
    print("prefill:", raw["prefill"], flush=True)
    if not args.no_write:
        write_section("user_calls", _markdown(raw), raw)


def _prompts(tokenizer) -> list[str]:
    from etjax.bench.corpus import lee_articles

    articles = lee_articles()
    return [tokenizer.decode(tokenizer.encode(articles[i])[:PROMPT_TOKENS]) for i in range(8)]


def _first_call() -> dict:
    # In a fresh process: everything a user's first `decode()` pays, loading excluded.
    import jax

    import etjax

    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **_: compiles.append(duration) if event == _COMPILE_EVENT else None
    )
    model = etjax.load_model()
    prompts = _prompts(model.tokenizer)
    before = len(compiles)
    started = time.perf_counter()
    etjax.decode(prompts, model=model, max_new_tokens=NEW_TOKENS, temperature=0.0)
    wall = time.perf_counter() - started
    return {
        "seconds": wall,
        "compilations": len(compiles) - before,
        "compile_seconds": float(sum(compiles[before:])),
    }


def _first_call_in_fresh_process() -> dict:
    # No persistent compilation cache: neither JAX's nor the one etjax turns on by default,
    # which a previous run would have filled with these very programs.
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["JAX_PLATFORMS"] = "cpu"
    env["ETJAX_COMPILATION_CACHE"] = "off"
    out = subprocess.run(
        [sys.executable, __file__, "--first-call"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _transformers(model_path: Path):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    hf = AutoModelForCausalLM.from_pretrained(
        model_path.parent, gguf_file=model_path.name, dtype=torch.float32
    )
    return hf.eval()


def _warm_calls(repeats: int) -> dict:
    import torch

    import etjax
    from etjax.loaders.embedded import smollm2_gguf_path

    model = etjax.load_model()
    hf = _transformers(smollm2_gguf_path())
    prompts = _prompts(model.tokenizer)
    ids = [model.tokenizer.encode(p) for p in prompts]
    width = max(len(i) for i in ids)
    pad = model.tokenizer.eos_token_ids[0]
    batch = torch.tensor([[pad] * (width - len(i)) + i for i in ids])
    mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])

    def run_etjax():
        return etjax.decode(prompts, model=model, max_new_tokens=NEW_TOKENS, ignore_eos=True)

    def run_transformers():
        with torch.no_grad():
            return hf.generate(
                batch,
                attention_mask=mask,
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=pad,
            )

    run_etjax()  # the first call compiles
    run_transformers()
    host = _host_share(model, prompts)
    seconds: dict[str, list[float]] = {"etjax": [], "transformers": []}
    for _ in range(repeats):
        for name, run in (("etjax", run_etjax), ("transformers", run_transformers)):
            started = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - started)
    tokens = PROMPTS * NEW_TOKENS
    rates = {k: [tokens / s for s in v] for k, v in seconds.items()}
    ratios = [a / b for a, b in zip(seconds["transformers"], seconds["etjax"], strict=True)]
    return {"seconds": seconds, "tokens_per_s": rates, "speedup": ratios, "host_share": host}


def _host_share(model, prompts: list[str]) -> float | None:
    # The engine's own clock of host work (scheduling, row setup, collection) over the call.
    try:
        from etjax.engine.engine import Engine
    except ImportError:
        return None
    engines = []
    original = Engine.__init__

    def record(self, *args, **kwargs):
        original(self, *args, **kwargs)
        engines.append(self)

    Engine.__init__ = record
    try:
        import etjax

        started = time.perf_counter()
        etjax.decode(prompts, model=model, max_new_tokens=NEW_TOKENS, ignore_eos=True)
        wall = time.perf_counter() - started
    finally:
        Engine.__init__ = original
    return float(sum(e.host_seconds for e in engines) / wall)


def _prefill(repeats: int) -> dict:
    import torch

    import etjax
    from etjax.bench.corpus import lee_articles
    from etjax.loaders.embedded import smollm2_gguf_path

    model = etjax.load_model()
    hf = _transformers(smollm2_gguf_path())
    ids = model.tokenizer.encode("\n\n".join(lee_articles()[:40]))[:DOCUMENT_TOKENS]
    text = model.tokenizer.decode(ids)
    n = len(model.tokenizer.encode(text))

    def run_etjax():
        return etjax.decode(text, model=model, max_new_tokens=1)

    def run_transformers():
        with torch.no_grad():
            return hf(torch.tensor([model.tokenizer.encode(text)]), use_cache=True).logits[0, -1]

    run_etjax()
    run_transformers()
    seconds: dict[str, list[float]] = {"etjax": [], "transformers": []}
    for _ in range(repeats):
        for name, run in (("etjax", run_etjax), ("transformers", run_transformers)):
            started = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - started)
    return {
        "tokens": n,
        "seconds": seconds,
        "tokens_per_s": {k: [n / s for s in v] for k, v in seconds.items()},
    }


def _ratio(rates: dict[str, list[float]]) -> float:
    return float(np.median(rates["etjax"]) / np.median(rates["transformers"]))


def _markdown(raw: dict) -> str:
    first, warm, prefill = raw["first_call"], raw["warm_calls"], raw["prefill"]
    host = warm["host_share"]
    lines = [
        "## `decode()` as a user meets it (SmolLM2-135M, float32, greedy)",
        "",
        f"`benchmarks/user_calls.py --repeats {raw['repeats']}`, {raw['date']}, "
        f"{raw['machine']}. SmolLM2-135M float32, "
        "greedy; median (min-max) over interleaved repetitions after a warm-up.",
        "",
        "| what | etjax | transformers | etjax / transformers |",
        "|---|---|---|---|",
        f"| first `decode()` of a process ({PROMPTS} prompts x {PROMPT_TOKENS} tokens, "
        f"{NEW_TOKENS} new) | {first['seconds']:.1f} s, {first['compilations']} compilations, "
        f"{first['compile_seconds']:.1f} s compiling | | |",
        f"| warm `decode()`, same call, tok/s | {median_spread(warm['tokens_per_s']['etjax'])} | "
        f"{median_spread(warm['tokens_per_s']['transformers'])} | "
        f"{median_spread(warm['speedup'])} |",
        f"| prefill of one {prefill['tokens']}-token document, tok/s | "
        f"{median_spread(prefill['tokens_per_s']['etjax'])} | "
        f"{median_spread(prefill['tokens_per_s']['transformers'])} | "
        f"{_ratio(prefill['tokens_per_s']):.2f} |",
        "",
        f"Host share of a warm call (the engine's scheduling, row setup and collection): "
        f"{'n/a' if host is None else f'{100 * host:.1f}%'}.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
