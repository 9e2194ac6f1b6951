"""Peak host memory while loading SmolLM2-135M, per file format and dtype, against the weights.

Issue 14 item 6 asks that loading never hold more than about 1.3x the weights' size: no
float32 host copy of the whole model kept alive while the final arrays are built.

Formats, all made in a temporary directory from the embedded model:
  gguf              the embedded GGUF itself (Q4_1 blocks, Q8_0 embedding)
  safetensors-f32   a Hugging Face directory with float32 weights (written here)
  safetensors-bf16  the same in bfloat16, as Hugging Face ships SmolLM2
  checkpoint-f32    `etjax convert smollm2 DST` (float32, the default)
  checkpoint-bf16   `etjax convert smollm2 DST --dtype bfloat16`
Each is loaded with `etjax.load_model(path, dtype=...)` for dtype float32 and bfloat16.

Method. Every load runs in a fresh child process, so no earlier allocation, cached file page
or compiled program of another row is counted. The child imports etjax and starts JAX's CPU
backend (one-off costs that are not the load's), then:
  1. resets the kernel's peak-RSS counter by writing 5 to /proc/self/clear_refs (Linux >= 4.0),
     so VmHWM restarts at the current RSS; `ru_maxrss` cannot be used for the peak because it
     also holds the peak of the imports, which can exceed the RSS at the start of the load;
  2. reads VmRSS: "RSS before";
  3. calls `load_model`, waits until every weight is ready;
  4. reads VmHWM: "peak", and VmRSS: "RSS after" (what the loaded model keeps).
"Peak increase" is peak - RSS before; "ratio" is peak increase / weights, where weights is the
sum of `nbytes` over the loaded `Weights` pytree. RSS counts the pages of memory-mapped model
files that the load touches as well as allocated memory, as the kernel does when it decides
who to kill. If clear_refs is not writable the child falls back to `ru_maxrss` and the table
says so.

The peak increase is split into four parts that add up to it:
  weights      the loaded arrays;
  tokenizer    what loading the tokenizer alone keeps (RSS after - RSS before), measured the
               same way in another fresh child; it is part of every load but not of the weights;
  other kept   RSS after - RSS before - weights - tokenizer: runtime state the load leaves
               behind (tensorstore's thread pools, modules imported on first use, heap that
               the allocator keeps for reuse);
  transient    peak - RSS after: memory the load held and gave back before returning, which
               is where a whole-model float32 copy or a second copy of a leaf would show.

    .venv/bin/python benchmarks/load_memory.py [--formats gguf,checkpoint-f32] [--dtypes float32]
        [--repeats 3]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "load_memory.md"
FORMATS = ("gguf", "safetensors-f32", "safetensors-bf16", "checkpoint-f32", "checkpoint-bf16")
DTYPES = ("float32", "bfloat16")
TARGET_RATIO = 1.3
MIB = 1 << 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--repeats", type=int, default=3, help="fresh loads per row")
    parser.add_argument(
        "--child", nargs=3, metavar=("WHAT", "PATH", "DTYPE"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_measure_child(*args.child)))
        return
    formats = args.formats.split(",")
    dtypes = args.dtypes.split(",")
    with tempfile.TemporaryDirectory(prefix="etjax-load-memory-") as scratch:
        sources = _make_sources(Path(scratch), formats)
        tokenizers = {f: _run_child("tokenizer", sources[f], "float32") for f in formats}
        rows = [
            (f, d, [_run_child("model", sources[f], d) for _ in range(args.repeats)], tokenizers[f])
            for f in formats
            for d in dtypes
        ]
    report = _report(rows)
    print(report)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(report)
    from benchmarks.perf_report import write_section

    # The page's title, one level down, is the section's.
    write_section("load-memory", "#" + report, {"rows": [list(row) for row in rows]})


# ---- child: one load, measured -------------------------------------------------------------


def _measure_child(what: str, path: str, dtype: str) -> dict:
    import jax
    import jax.numpy as jnp

    import etjax

    jnp.zeros(8).block_until_ready()  # start the CPU backend before the baseline
    hwm_reset = _reset_peak_rss()
    before = _proc_status_kib("VmRSS")
    started = time.perf_counter()
    if what == "model":
        model = etjax.load_model(None if path == "embedded" else path, dtype=dtype)
        jax.block_until_ready(model.weights)
        weights_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(model.weights))
    else:
        tokenizer = _load_tokenizer_only(path)  # noqa: F841 (kept alive for "RSS after")
        weights_bytes = 0
    seconds = time.perf_counter() - started
    if hwm_reset:
        peak = _proc_status_kib("VmHWM")
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {
        "weights_bytes": weights_bytes,
        "rss_before": before * 1024,
        "peak": peak * 1024,
        "rss_after": _proc_status_kib("VmRSS") * 1024,
        "seconds": seconds,
        "hwm_reset": hwm_reset,
    }


def _load_tokenizer_only(path: str):
    # What each format's loader does for the tokenizer (etjax/loaders/resolve.py).
    from etjax.loaders.checkpoint import is_etjax_checkpoint
    from etjax.loaders.embedded import smollm2_gguf_path
    from etjax.loaders.gguf_weights import open_gguf
    from etjax.tokenizer import Tokenizer

    if path == "embedded":
        return Tokenizer.from_gguf(open_gguf(smollm2_gguf_path()))
    if is_etjax_checkpoint(Path(path)):
        return Tokenizer.from_hf_dir(Path(path) / "tokenizer")
    return Tokenizer.from_hf_dir(path)


def _reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _proc_status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _run_child(what: str, path: str, dtype: str) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    done = subprocess.run(
        [sys.executable, __file__, "--child", what, path, dtype],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"loading {what} {path} ({dtype}) failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---- parent: the model in every format ---------------------------------------------------


def _make_sources(scratch: Path, formats: list[str]) -> dict[str, str]:
    sources = {"gguf": "embedded"}
    needs_model = any(f.startswith("safetensors") for f in formats)
    model = None
    if needs_model:
        import etjax

        model = etjax.load_model()
    for fmt in formats:
        if fmt.startswith("safetensors"):
            dtype = "bfloat16" if fmt.endswith("bf16") else "float32"
            sources[fmt] = str(_write_hf_dir(model, scratch / fmt, dtype))
        elif fmt.startswith("checkpoint"):
            dtype = "bfloat16" if fmt.endswith("bf16") else "float32"
            destination = scratch / fmt
            convert = ["convert", "smollm2", str(destination), "--dtype", dtype]
            subprocess.run(
                [sys.executable, "-m", "etjax.cli", *convert],
                env=dict(os.environ, JAX_PLATFORMS="cpu"),
                check=True,
                capture_output=True,
            )
            sources[fmt] = str(destination)
        elif fmt != "gguf":
            raise SystemExit(f"unknown format {fmt!r}; allowed: {FORMATS}")
    return sources


def _write_hf_dir(model, directory: Path, dtype: str) -> Path:
    # Undo etjax's fusing: Hugging Face stores each projection [out, in], as etjax does.
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    cfg = model.config
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32

    def host(a) -> np.ndarray:
        return np.ascontiguousarray(np.asarray(a, dtype=np.float32).astype(np_dtype))

    q = cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    tensors = {"model.embed_tokens.weight": host(model.weights.embed)}
    for i, layer in enumerate(model.weights.layers):
        p = f"model.layers.{i}."
        qkv = np.asarray(layer.wqkv)
        gate_up = np.asarray(layer.w_gate_up)
        tensors |= {
            p + "input_layernorm.weight": host(layer.attn_norm),
            p + "self_attn.q_proj.weight": host(qkv[:q]),
            p + "self_attn.k_proj.weight": host(qkv[q : q + kv]),
            p + "self_attn.v_proj.weight": host(qkv[q + kv :]),
            p + "self_attn.o_proj.weight": host(layer.wo),
            p + "post_attention_layernorm.weight": host(layer.mlp_norm),
            p + "mlp.gate_proj.weight": host(gate_up[: cfg.intermediate_size]),
            p + "mlp.up_proj.weight": host(gate_up[cfg.intermediate_size :]),
            p + "mlp.down_proj.weight": host(layer.w_down),
        }
    tensors["model.norm.weight"] = host(model.weights.final_norm)
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "model.safetensors"))
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_act": "silu",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "torch_dtype": dtype,
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    model.tokenizer.save(directory)
    return directory


# ---- report ---------------------------------------------------------------------------------


def _report(rows: list[tuple[str, str, list[dict], dict]]) -> str:
    from etjax.bench.perf_doc import machine_line

    lines = [
        "# Load-time memory",
        "",
        f"Written by `benchmarks/load_memory.py` on {datetime.date.today()}.",
        f"Machine: {machine_line()}.",
        f"Target: peak increase at most {TARGET_RATIO}x the weights (issue 14, item 6).",
        "All sizes in MiB; peak increase = weights + tokenizer + other kept + transient.",
        "Each row: the median by peak increase of its fresh loads; the ratio's range in brackets.",
        "",
        "| format | dtype | weights | RSS before | peak | peak increase | ratio "
        "| tokenizer | other kept | transient | load s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    fallback = False
    for fmt, dtype, runs, tok in rows:
        # The run with the median peak increase; the ratio cell also gives the range over runs.
        ratios = sorted((run["peak"] - run["rss_before"]) / run["weights_bytes"] for run in runs)
        r = sorted(runs, key=lambda run: run["peak"] - run["rss_before"])[len(runs) // 2]
        increase = r["peak"] - r["rss_before"]
        kept = r["rss_after"] - r["rss_before"]
        tokenizer = tok["rss_after"] - tok["rss_before"]
        ratio = increase / r["weights_bytes"]
        flag = "" if ratios[-1] <= TARGET_RATIO else " (over)"
        spread = f" ({ratios[0]:.2f}-{ratios[-1]:.2f})" if len(runs) > 1 else ""
        fallback |= not all(run["hwm_reset"] for run in runs)
        cells = [
            r["weights_bytes"],
            r["rss_before"],
            r["peak"],
            increase,
        ]
        parts = [tokenizer, kept - r["weights_bytes"] - tokenizer, r["peak"] - r["rss_after"]]
        lines.append(
            f"| {fmt} | {dtype} | "
            + " | ".join(f"{c / MIB:.1f}" for c in cells)
            + f" | {ratio:.2f}{spread}{flag} | "
            + " | ".join(f"{c / MIB:.1f}" for c in parts)
            + f" | {r['seconds']:.1f} |"
        )
    lines += [
        "",
        "RSS before: after imports and JAX start-up, with the peak counter reset. peak: VmHWM "
        "after the load. tokenizer: RSS kept by loading only the tokenizer, in its own process. "
        "other kept: what else the loaded process keeps beyond the weights. transient: peak - "
        "RSS after, memory held during the load only. See the script's docstring for the method.",
    ]
    if fallback:
        lines.append(
            "Some rows could not reset VmHWM; their peak is ru_maxrss and may include imports."
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
