"""Cost of the entropy estimators and of the sampling stage relative to a decode step.

Batch 32, float32, this machine. The decode step is `decode_steps` (8 steps per call, greedy,
context ~128), divided by 8; it already contains one exact entropy and the greedy sampling
stage, so the fractions below are of a whole step. Each estimator and each sampler
configuration is timed alone on [32, V] logits, jitted, warm, median of 20 calls.
Writes the "entropy_cost" section of docs/PERF.md (SmolLM2, V = 49,152), or with
`--model gemma3-270m` the "entropy_cost_gemma3" section (V = 262,144: where the paper's claim
of cheap entropy meets a large vocabulary).

    .venv/bin/python benchmarks/entropy_cost.py [--model gemma3-270m]
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import shlex
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.perf_report import machine_line, median_spread, write_section

BATCH = 32


def _time(fn, *args, repeats: int = 20) -> list[float]:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - started)
    return times


def main() -> None:
    import etjax
    from etjax.engine_build import RequestSettings, RuntimeOptions
    from etjax.entropy import estimators as est
    from etjax.sampling.sampler import initial_sampler_state, sample_next
    from etjax.sampling.settings import SamplerSettings, pack_sampler_params

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model name (default: SmolLM2)")
    args = parser.parse_args()
    model = etjax.load_model(args.model, dtype="float32")
    label = "SmolLM2" if args.model is None else args.model
    section = "entropy_cost" if args.model is None else "entropy_cost_gemma3"
    # Interleaved pairs: the machine drifts by more than the difference being measured.
    step_ms, bare_ms, differences = [], [], []
    for _ in range(3):
        full = _decode_step_ms(model, RequestSettings, RuntimeOptions)
        bare = _decode_step_ms(model, RequestSettings, RuntimeOptions, bare_stage=True)
        step_ms += full
        bare_ms += bare
        differences.append(float(np.median(full) - np.median(bare)))
    vocab = model.config.vocab_size
    logits = jnp.asarray(np.random.default_rng(0).normal(0, 3, (BATCH, vocab)).astype(np.float32))

    rows: list[tuple[str, list[float]]] = []
    estimators = {
        "exact entropy": jax.jit(est.exact_entropy),
        "entropy + varentropy": jax.jit(est.entropy_and_varentropy),
        "top-k entropy, k = 64": jax.jit(lambda z: est.topk_entropy(z, 64)),
        "tail bounds, k = 64": jax.jit(lambda z: est.tail_bounds(z, 64)),
        "tail bounds, k = 1024": jax.jit(lambda z: est.tail_bounds(z, 1024)),
    }
    for name, fn in estimators.items():
        rows.append((name, [t * 1e3 for t in _time(fn, logits)]))

    samplers = {
        "sampling stage: greedy": SamplerSettings(),
        "sampling stage: temperature 0.8": SamplerSettings(temperature=0.8),
        "sampling stage: T 0.8 + top-p 0.9 + min-p": SamplerSettings(
            temperature=0.8, top_p=0.9, min_p=0.05
        ),
        # Past the 256 candidates on these logits (normal, sd 3): the full-sort fallback.
        "sampling stage: T 0.8 + top-p 0.999 (whole-row sort)": SamplerSettings(
            temperature=0.8, top_p=0.999
        ),
        "sampling stage: T 0.8 + typical-p 0.9": SamplerSettings(temperature=0.8, typical_p=0.9),
        "sampling stage: penalties + T 0.8": SamplerSettings(
            temperature=0.8, repetition_penalty=1.1, frequency_penalty=0.2
        ),
        "sampling stage: entropic controller": SamplerSettings(sampler="entropic"),
        "sampling stage: Mirostat v2": SamplerSettings(sampler="mirostat_v2", temperature=1.0),
        "sampling stage: EDT": SamplerSettings(sampler="edt"),
    }
    counts = jnp.zeros((BATCH, vocab), jnp.int32)
    in_prompt = jnp.zeros((BATCH, vocab), bool)
    index = jnp.zeros((BATCH,), jnp.int32)
    stage = jax.jit(sample_next)
    for name, s in samplers.items():
        params = pack_sampler_params([s] * BATCH, BATCH)
        state = initial_sampler_state(params)
        times = _time(stage, logits, params, state, counts, in_prompt, index)
        rows.append((name, [t * 1e3 for t in times]))

    raw = {
        "machine": machine_line(),
        "date": str(datetime.date.today()),
        "decode_step_ms": step_ms,
        "decode_step_bare_argmax_ms": bare_ms,
        "in_step_differences_ms": differences,
        "rows": {name: times for name, times in rows},
    }
    step = float(np.median(step_ms))
    in_step = float(np.median(differences))
    lines = [
        f"## Entropy estimators and the sampling stage vs a decode step ({label}, batch 32)",
        "",
        f"Measured {raw['date']} on {raw['machine']}. Command: "
        f"`.venv/bin/python benchmarks/entropy_cost.py {shlex.join(sys.argv[1:])}`. Decode step "
        "(greedy, context ~128, whole step including its own entropy and sampling): "
        f"{median_spread(step_ms)} ms. The first row is measured inside the step (the step with "
        "the greedy stage minus the step with a bare argmax); the others are timed alone on "
        f"[32, {vocab}] float32 logits, median (min-max) of 20 warm calls.",
        "",
        "| operation | ms | share of a decode step |",
        "|---|---|---|",
        "| in the step: the greedy stage (entropy, log-prob, argmax) vs a bare argmax | "
        f"{in_step:.3g} (pairs: {', '.join(f'{d:.3g}' for d in differences)}) | "
        f"{in_step / step:.1%} |",
    ]
    for name, times in rows:
        lines.append(f"| {name} | {median_spread(times)} | {np.median(times) / step:.1%} |")
    write_section(section, "\n".join(lines), raw)
    print("\n".join(lines))


def _decode_step_ms(model, RequestSettings, RuntimeOptions, bare_stage: bool = False):
    # Time whole decode bursts through the engine's own loop: 32 prompts of 64 tokens, 128 new.
    # With bare_stage the entropy-and-sampling stage is replaced by a bare argmax, so the
    # difference is what the stage costs inside the step (fused with the rest), not alone.
    from etjax.engine import build as gen
    from etjax.engine import device
    from etjax.runtime import commit
    from etjax.sampling import sampler

    if bare_stage:  # the name the decode step's sampling calls (etjax/runtime/commit.py)
        commit.sample_next = _bare_stage
        jax.clear_caches()

    prompts = [[100 + i] * 64 for i in range(BATCH)]
    settings = [RequestSettings(max_new_tokens=128, ignore_eos=True)] * BATCH
    times: list[float] = []
    original = device.decode_steps  # the name the engine's backend calls

    def timed(*args, **kwargs):
        started = time.perf_counter()
        out = original(*args, **kwargs)
        jax.block_until_ready(out)
        steps_run = inspect.signature(original).bind(*args, **kwargs).arguments["num_steps"]
        times.append((time.perf_counter() - started) / steps_run)
        return out

    device.decode_steps = timed
    try:
        gen.generate_ids(model.weights, model.config, model.tokenizer, prompts, settings)  # warm
        times.clear()
        gen.generate_ids(model.weights, model.config, model.tokenizer, prompts, settings)
    finally:
        device.decode_steps = original
        commit.sample_next = sampler.sample_next
        jax.clear_caches()
    return [t * 1e3 for t in times]


def _bare_stage(logits, params, state, counts, in_prompt, token_index, entropy=None):
    from etjax.sampling.sampler import SampleInfo, first_argmax

    zeros = jnp.zeros(logits.shape[0], jnp.float32)
    info = SampleInfo(
        model_entropy=zeros,
        logprob=zeros,
        sampled_entropy=zeros,
        temperature=zeros,
        calibrated_entropy=zeros,
        raw_entropy=zeros,
    )
    return first_argmax(logits), info, state


if __name__ == "__main__":
    main()
