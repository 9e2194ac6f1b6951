"""etjax vs transformers `generate`, float32, greedy, on this CPU (SmolLM2-135M or Gemma 3 270M).

Both engines run the same dequantized GGUF weights on the same token ids, side by side in one
process, repetitions interleaved. Reports generation throughput at batch 1/8/32, prefill
throughput, compile time, peak memory and the fraction of the memory-bandwidth roofline at
batch 1, and writes the "decode_throughput" section of docs/PERF.md ("decode_throughput_gemma3"
with `--model gemma3-270m`, the optional Gemma 3 packages installed).

    .venv/bin/python benchmarks/decode_throughput.py [--new-tokens 128] [--repeats 3]
        [--model gemma3-270m]
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.perf_report import machine_line, median_spread, write_section

PROMPT_TOKENS = 32
PREFILL_TOKENS = 512
SMOLLM2 = "smollm2-135m"
# The models this bench compares, by name: their title in PERF.md.
MODELS = {SMOLLM2: "SmolLM2-135M", "gemma3-270m": "Gemma 3 270M, Q4_K_M dequantized"}


def _gguf_path(model: str) -> Path:
    if model == SMOLLM2:
        from etjax.loaders.embedded import smollm2_gguf_path

        return smollm2_gguf_path()
    from etjax.loaders.gemma_package import gemma3_270m_gguf_path

    return gemma3_270m_gguf_path()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--model", choices=sorted(MODELS), default=SMOLLM2)
    parser.add_argument("--memory-probe", choices=["etjax", "transformers"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_probe:
        _memory_probe(args.memory_probe, args.new_tokens, args.model)
        return
    batches = [int(b) for b in args.batches.split(",")]

    engines = _Engines(args.model)
    lee = _lee()
    raw: dict = {"machine": machine_line(), "date": str(datetime.date.today()), "runs": {}}

    compile_s = engines.etjax_compile_time(_prompt_ids(engines, lee, 1), args.new_tokens)
    raw["etjax_first_call_s"] = compile_s

    for batch in batches:
        prompts = _prompt_ids(engines, lee, batch)
        times: dict[str, list[float]] = {"etjax": [], "transformers": []}
        outputs = {}
        engines.run_etjax(prompts, args.new_tokens)  # warm-up: compile every shape of this batch
        engines.run_transformers(prompts[:1], 4)
        for _ in range(args.repeats):
            for name in ("etjax", "transformers"):
                run = engines.run_etjax if name == "etjax" else engines.run_transformers
                started = time.perf_counter()
                outputs[name] = run(prompts, args.new_tokens)
                times[name].append(time.perf_counter() - started)
        same = np.mean(
            [a == b for a, b in zip(outputs["etjax"], outputs["transformers"], strict=True)]
        )
        raw["runs"][batch] = {
            "seconds": times,
            "tokens_per_s": {k: [batch * args.new_tokens / t for t in v] for k, v in times.items()},
            "identical_outputs": float(same),
        }
        print(f"batch {batch}: {raw['runs'][batch]['tokens_per_s']}", flush=True)

    raw["prefill"] = engines.prefill_rates(lee, args.repeats)
    raw["roofline"] = engines.roofline(raw["runs"].get(1), args.new_tokens)
    raw["peak_rss_mb"] = {
        name: _peak_rss(name, args.new_tokens, args.model) for name in ("etjax", "transformers")
    }
    section = "decode_throughput" if args.model == SMOLLM2 else "decode_throughput_gemma3"
    write_section(section, _markdown(raw, args), raw)
    print(json.dumps({k: v for k, v in raw.items() if k != "runs"}, indent=2))


class _Engines:
    def __init__(self, model: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        import etjax

        path = _gguf_path(model)
        self.model = etjax.load_model(path, dtype="float32")
        self.hf = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        ).eval()
        self.torch = torch

    def run_etjax(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        from etjax.engine_build import RequestSettings, generate_ids

        settings = [RequestSettings(max_new_tokens=new_tokens, ignore_eos=True)] * len(prompts)
        outs = generate_ids(
            self.model.weights, self.model.config, self.model.tokenizer, prompts, settings
        )
        return [o.token_ids for o in outs]

    def run_transformers(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        ids = self.torch.tensor(prompts)
        with self.torch.no_grad():
            out = self.hf.generate(
                ids,
                attention_mask=self.torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
            )
        return out[:, ids.shape[1] :].tolist()

    def etjax_compile_time(self, prompts: list[list[int]], new_tokens: int) -> float:
        started = time.perf_counter()
        self.run_etjax(prompts, new_tokens)
        return time.perf_counter() - started

    def prefill_rates(self, lee: list[str], repeats: int) -> dict:
        from etjax.engine_build import RequestSettings, generate_ids

        tokens = self.model.tokenizer.encode(" ".join(lee[:20]))[:PREFILL_TOKENS]
        settings = [RequestSettings(max_new_tokens=1, ignore_eos=True)]
        m = self.model
        generate_ids(m.weights, m.config, m.tokenizer, [tokens], settings)  # compile
        rates: dict[str, list[float]] = {"etjax": [], "transformers": []}
        for _ in range(repeats):
            started = time.perf_counter()
            generate_ids(m.weights, m.config, m.tokenizer, [tokens], settings)
            rates["etjax"].append(len(tokens) / (time.perf_counter() - started))
            ids = self.torch.tensor([tokens])
            started = time.perf_counter()
            with self.torch.no_grad():
                self.hf(ids, logits_to_keep=1)
            rates["transformers"].append(len(tokens) / (time.perf_counter() - started))
        return rates

    def roofline(self, batch1: dict | None, new_tokens: int) -> dict:
        cfg = self.model.config
        weight_bytes = sum(x.nbytes for x in jax.tree.leaves(self.model.weights))
        kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
        mean_context = PROMPT_TOKENS + new_tokens / 2
        bytes_per_step = weight_bytes + kv_per_token * mean_context
        bandwidth = _read_bandwidth()
        result = {
            "weight_bytes": weight_bytes,
            "bytes_per_step": bytes_per_step,
            "read_bandwidth_gb_s": bandwidth / 1e9,
            "roofline_tokens_per_s": bandwidth / bytes_per_step,
        }
        if batch1:
            measured = float(np.median(batch1["tokens_per_s"]["etjax"]))
            result["etjax_tokens_per_s"] = measured
            result["fraction"] = measured / result["roofline_tokens_per_s"]
        return result


def _read_bandwidth() -> float:
    """Bytes read per second by a jitted matrix-vector product over a resident 512 MiB matrix.

    A decode step at batch 1 is exactly such reads of the weights, so this is the ceiling that
    matters; a plain copy would also count page faults of the freshly allocated output.
    """
    matrix = jnp.ones((128 * 1024, 1024), jnp.float32)
    vector = jnp.ones((1024,), jnp.float32)
    gemv = jax.jit(lambda m, v: m @ v)
    gemv(matrix, vector).block_until_ready()
    times = []
    for _ in range(9):
        started = time.perf_counter()
        gemv(matrix, vector).block_until_ready()
        times.append(time.perf_counter() - started)
    return matrix.nbytes / float(np.median(times))


def _lee() -> list[str]:
    import importlib.resources

    path = importlib.resources.files("gensim") / "test" / "test_data" / "lee_background.cor"
    return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _prompt_ids(engines: _Engines, lee: list[str], batch: int) -> list[list[int]]:
    # Equal-length prompts, so transformers needs no padding and both engines see the same ids.
    return [engines.model.tokenizer.encode(lee[i])[:PROMPT_TOKENS] for i in range(batch)]


def _peak_rss(engine: str, new_tokens: int, model: str) -> float:
    # Each engine in its own process: peak resident memory of a batch-8 run, model load included.
    cmd = [sys.executable, __file__, "--memory-probe", engine, "--new-tokens", str(new_tokens)]
    cmd += ["--model", model]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def _memory_probe(engine: str, new_tokens: int, model: str) -> None:
    from etjax.tokenizer import Tokenizer

    path = _gguf_path(model)
    lee = _lee()
    tokenizer = Tokenizer.from_gguf(path)
    prompts = [tokenizer.encode(lee[i])[:PROMPT_TOKENS] for i in range(8)]
    if engine == "etjax":
        import etjax
        from etjax.engine_build import RequestSettings, generate_ids

        loaded = etjax.load_model(path, dtype="float32")
        settings = [RequestSettings(max_new_tokens=new_tokens, ignore_eos=True)] * 8
        generate_ids(loaded.weights, loaded.config, loaded.tokenizer, prompts, settings)
    else:
        import torch
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
        ids = torch.tensor(prompts)
        with torch.no_grad():
            hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
            )
    # VmHWM, not getrusage: ru_maxrss survives fork+exec on Linux and would report the parent's.
    status = Path("/proc/self/status").read_text()
    peak_kb = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM"))
    print(peak_kb / 1024)


def _markdown(raw: dict, args: argparse.Namespace) -> str:
    lines = [
        f"## Decode throughput: etjax vs transformers ({MODELS[args.model]}, float32, greedy)",
        "",
        f"Measured {raw['date']} on {raw['machine']}.",
        f"Command: `.venv/bin/python benchmarks/decode_throughput.py --new-tokens "
        f"{args.new_tokens} --repeats {args.repeats}"
        + ("" if args.batches == "1,8,32" else f" --batches {args.batches}")
        + ("" if args.model == SMOLLM2 else f" --model {args.model}")
        + "`.",
        f"Prompts: the first {PROMPT_TOKENS} tokens of Lee corpus articles, {args.new_tokens} new "
        "tokens each (eos ignored), end-to-end generation time (prefill included), warm-up "
        "excluded, median (min-max) of the repeats, engines interleaved.",
        "",
        "| batch | etjax tok/s | transformers tok/s | ratio (median) | identical greedy outputs |",
        "|---|---|---|---|---|",
    ]
    for batch, run in raw["runs"].items():
        tps = run["tokens_per_s"]
        ratio = float(np.median(tps["etjax"]) / np.median(tps["transformers"]))
        lines.append(
            f"| {batch} | {median_spread(tps['etjax'])} | {median_spread(tps['transformers'])} "
            f"| {ratio:.2f}x | {run['identical_outputs']:.0%} |"
        )
    pre = raw["prefill"]
    roof = raw["roofline"]
    lines += [
        "",
        f"- Prefill of a {PREFILL_TOKENS}-token prompt: etjax {median_spread(pre['etjax'])} "
        f"tok/s, transformers {median_spread(pre['transformers'])} tok/s.",
        f"- First etjax call (compilation of the batch-1 programs included): "
        f"{raw['etjax_first_call_s']:.1f} s.",
        f"- Peak resident memory of a batch-8 run in its own process (load included): etjax "
        f"{raw['peak_rss_mb']['etjax']:.0f} MB, transformers "
        f"{raw['peak_rss_mb']['transformers']:.0f} MB.",
        f"- Roofline at batch 1: {roof['bytes_per_step'] / 1e6:.0f} MB read per step (weights "
        f"{roof['weight_bytes'] / 1e6:.0f} MB + KV at the mean context), read bandwidth "
        f"{roof['read_bandwidth_gb_s']:.1f} GB/s (jitted matrix-vector product over 512 MiB) -> "
        f"ceiling {roof['roofline_tokens_per_s']:.1f} tok/s; etjax reaches "
        f"{roof.get('fraction', float('nan')):.0%} of it.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
