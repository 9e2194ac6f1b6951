"""Weights kept quantized against float32 (SmolLM2-135M-Instruct Q4_1, as shipped), side by side
in one run: each `load_model(weights=...)` form's resident bytes, greedy decode speed and
perplexity.

- bytes: what the weights hold resident, against the GGUF file's tensor bytes;
- decode: `etjax.decode()` with the engine's defaults, greedy, B prompts (Lee articles'
  openings) of N new tokens each, at batch 1 and batch 8; the forms interleaved, the first
  call of each excluded (it compiles), the best of R repeats, in tokens per second of wall
  time and per second of the process's CPU time (all threads; what other work on a shared
  machine does not inflate);
- perplexity: teacher-forced over the first L tokens of D Lee articles, one prefill each
  (tests/model_runner.py's `full_logits`), against the float32 dequantization of the same
  file: "stored" holds the file's values, "int8" requantizes them per output channel.

Writes the "weight_formats" section of docs/PERF.md unless --no-write.

    .venv/bin/python benchmarks/weight_formats.py [--weights float32,stored,int8] [--new 64]
        [--repeats 2] [--documents 6] [--length 512] [--no-write]
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))

from benchmarks.perf_report import machine_line, write_section


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", default="float32,stored,int8")
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--documents", type=int, default=6)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--note", default="", help="a line under the table (the machine's load)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    import etjax
    from etjax.bench.corpus import lee_articles
    from etjax.gguf_file import read_gguf
    from etjax.loaders.embedded import smollm2_gguf_path
    from tests.model_runner import full_logits

    path = smollm2_gguf_path()
    forms = [w for w in args.weights.split(",") if w]
    models = {w: etjax.load_model(path, weights=w) for w in forms}
    file_bytes = sum(t.nbytes for t in read_gguf(path).tensors)
    articles = lee_articles()
    prompts = [a[:200] for a in articles[:8]]
    speed: dict[str, float] = {}
    cpu_speed: dict[str, float] = {}
    for batch in (1, 8):
        for model in models.values():  # first calls: compiles
            etjax.decode(prompts[:batch], model=model, max_new_tokens=args.new, ignore_eos=True)
        for _ in range(args.repeats):
            for form, model in models.items():
                started, cpu = time.perf_counter(), time.process_time()
                results = etjax.decode(
                    prompts[:batch], model=model, max_new_tokens=args.new, ignore_eos=True
                )
                tokens = sum(len(r.token_ids) for r in results)
                rate = tokens / (time.perf_counter() - started)
                cpu_rate = tokens / (time.process_time() - cpu)
                key = f"{form} b{batch}"
                speed[key] = max(speed.get(key, 0.0), rate)
                cpu_speed[key] = max(cpu_speed.get(key, 0.0), cpu_rate)
                print(f"batch {batch} {form}: {rate:.1f} tok/s, {cpu_rate:.1f} per CPU-s")
    tokenizer = models[forms[0]].tokenizer
    docs = [ids[: args.length] for ids in map(tokenizer.encode, articles)]
    ids = np.asarray([d for d in docs if len(d) == args.length][: args.documents], np.int32)
    perplexity = {}
    for form, model in models.items():
        logits = jnp.asarray(full_logits(model.weights, model.config, ids)[:, :-1])
        logprobs = jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, 1:, None], axis=-1)
        perplexity[form] = float(np.exp(-float(logprobs.mean())))
        print(f"perplexity {form}: {perplexity[form]:.4f}", flush=True)

    base = "float32" if "float32" in models else forms[0]
    rows = [
        "| weights | resident MB | x file | batch 1 tok/s (per CPU-s) | batch 8 tok/s "
        "(per CPU-s) | perplexity | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for form, model in models.items():
        resident = model.weights_bytes
        rows.append(
            f"| {form} ({model.weights_format}) | {resident / 1e6:.1f} | "
            f"{resident / file_bytes:.2f} | {speed[f'{form} b1']:.1f} "
            f"({cpu_speed[f'{form} b1']:.1f}) | {speed[f'{form} b8']:.1f} "
            f"({cpu_speed[f'{form} b8']:.1f}) | {perplexity[form]:.4f} | "
            f"{perplexity[form] / perplexity[base]:.5f} |"
        )
    command = (
        f"benchmarks/weight_formats.py --weights {args.weights} --new {args.new} "
        f"--repeats {args.repeats} --documents {len(ids)} --length {args.length}"
    )
    markdown = "\n".join(
        [
            "## Weights kept quantized: SmolLM2-135M-Instruct Q4_1 as shipped, by `weights` form",
            "",
            f"{machine_line()}, {datetime.date.today()}; `{command}`. Decode: `etjax.decode()`"
            f" with the engine's defaults, greedy, {args.new} new tokens a prompt, best of "
            f"{args.repeats}; perplexity: the first {args.length} tokens of {len(ids)} Lee "
            "articles, teacher forced, ratio against float32 (the file's own dequantization).",
            "",
            *rows,
            "",
            *([args.note] if args.note else []),
        ]
    )
    print(markdown)
    raw = {
        "file_tensor_bytes": file_bytes,
        "resident_bytes": {f: m.weights_bytes for f, m in models.items()},
        "tokens_per_second": speed,
        "tokens_per_cpu_second": cpu_speed,
        "perplexity": perplexity,
    }
    if not args.no_write:
        write_section("weight_formats", markdown, raw)


if __name__ == "__main__":
    main()
