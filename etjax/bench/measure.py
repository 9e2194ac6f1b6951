"""One configuration on one workload, timed: every request submitted at its arrival time to a
fresh engine, the engine stepped until idle, and what each request and the run cost, recorded.

Requests sample with the config's sampler and a seed per request (its index), so two configs
with the same sampler and pruning produce the same tokens and only differ in when each request
runs. `greedy=True` replaces the sampler by argmax decoding, for the quality comparisons.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import numpy as np

from etjax.bench.workloads import WorkloadRequest
from etjax.engine_build import build_engine, workload_pages
from etjax.entropy.cost import CostModel
from etjax.plot import DEFAULT_FIELDS
from etjax.run_config import RunConfig
from etjax.runtime.options import RequestSettings, SequenceOutput
from etjax.sampling.settings import SamplerSettings


class CompileClock:
    """Seconds XLA spent compiling, and the programs it compiled, since this process started
    (JAX's monitoring events).

    A timed run that compiles measures the compiler, not the engine; `measure` records how
    much of each run was compilation so a reader can see that the warm-up did its job.
    """

    seconds = 0.0
    programs = 0
    _listening = False

    @classmethod
    def start(cls) -> None:
        if not cls._listening:
            import jax.monitoring

            jax.monitoring.register_event_duration_secs_listener(cls._on_event)
            cls._listening = True

    @classmethod
    def _on_event(cls, event: str, duration: float, **_) -> None:
        if event.endswith("backend_compile_duration"):
            cls.seconds += duration
            cls.programs += 1


def request_settings(
    config: RunConfig,
    workload: Sequence[WorkloadRequest],
    greedy: bool = False,
    equal_length: bool = False,
) -> list[RequestSettings]:
    """Each request's settings under `config`: its sampler, seeded by the request's index;
    with `equal_length`, generating past end-of-sequence to exactly its `max_new_tokens`,
    so every config does the same work."""
    settings = []
    for i, request in enumerate(workload):
        sampler = SamplerSettings(temperature=0.0) if greedy else config.sampler
        settings.append(
            RequestSettings(
                request.max_new_tokens,
                ignore_eos=equal_length,
                sampler=dataclasses.replace(sampler, seed=i),
            )
        )
    return settings


def measure(
    model,
    config: RunConfig,
    workload: Sequence[WorkloadRequest],
    arrivals: Sequence[float],
    greedy: bool = False,
    equal_length: bool = False,
) -> dict:
    """Run `workload` under `config` with `arrivals` (seconds after start); the raw record.
    `equal_length`: every request generates exactly its `max_new_tokens` (request_settings).

    Per request: latencies (end-to-end, time to first token, per token), tokens, tau, bytes,
    the kept-block fraction and KV bytes of its decode steps, its token ids and, for the plots,
    its per-token traces. Per run: makespan, throughput, host and device time per step.
    """
    prompts = [r.token_ids(model.tokenizer) for r in workload]
    settings = request_settings(config, workload, greedy, equal_length)
    # The model's entropy calibration, if it was loaded with one, is an engine setting.
    options = dataclasses.replace(config.options, calibration=model.calibration)
    engine = build_engine(
        model.weights,
        model.config,
        model.tokenizer,
        options,
        workload_pages(prompts, settings, options),
    )
    # The engine's own cost model: its weights as held (blocks, int8 or floats) and its KV's.
    cost = engine.backend.cost
    CompileClock.start()
    compiled_before = CompileClock.seconds, CompileClock.programs
    start = time.perf_counter()
    handles = [
        engine.submit(p, s, r.priority, arrival_time=start + float(a))
        for p, s, r, a in zip(prompts, settings, workload, arrivals, strict=True)
    ]
    engine.run_until_idle()
    makespan = time.perf_counter() - start
    requests = [
        _request_record(h.result(), len(p), cost) for h, p in zip(handles, prompts, strict=True)
    ]
    steps = max(engine.decode_rounds * options.steps_per_sync, 1)
    tokens = sum(r["generated_tokens"] for r in requests)
    return {
        "config": config.name,
        "greedy": greedy,
        "makespan_s": makespan,
        "throughput_tok_s": tokens / makespan,
        "host_ms_per_step": 1e3 * engine.host_seconds / steps,
        "device_ms_per_step": 1e3 * engine.device_seconds / steps,
        "compile_s": CompileClock.seconds - compiled_before[0],
        "programs_compiled": CompileClock.programs - compiled_before[1],
        "model_passes": engine.model_passes,
        # The model's per-token constants, for the bytes and FLOPs per generated token.
        "cost": {
            "weight_bytes": cost.weight_bytes,
            "matmul_flops_per_token": cost.matmul_flops_per_token,
            "attention_flops_per_key": cost.attention_flops_per_key,
            "kv_bytes_per_key": cost.kv_bytes_per_key,
        },
        "requests": requests,
    }


def _request_record(out: SequenceOutput, prompt_tokens: int, cost: CostModel) -> dict:
    n = len(out.token_ids)
    # kept_blocks[i] was read by the forward pass that fed token i, over prompt + i + 1
    # positions; the pass after the last token does not run when the request finishes.
    blocks = [
        -(-(prompt_tokens + i + 1) // cost.page_size) for i in range(n) if out.kept_blocks[i] > 0
    ]
    kept = [k for k in out.kept_blocks if k > 0]
    ps = cost.page_size
    # Sliding-window layers read at most their window, pruned or not (CostModel.layer_keys).
    keys = cost.layer_keys(np.asarray(kept) * ps, np.asarray(blocks) * ps, xp=np)
    spared = shared_keys(out, cost)
    kv_bytes = (float(np.sum(keys)) - spared) * cost.kv_bytes_per_key
    return {
        **out.metrics,
        # What the pass read: a prefix it shared with other rows counts once for them all
        # (cascade attention), in the bytes and in d tau / d C; every key still costs its
        # row the FLOPs of attending to it.
        "cost_bytes": out.metrics.get("cost_bytes", 0.0) - spared * cost.kv_bytes_per_key,
        "keys_attended": float(np.sum(keys)),
        "token_ids": list(out.token_ids),
        "text": out.text,
        "finish_reason": out.finish_reason,
        "kept_fraction": float(np.mean(np.array(kept) / np.array(blocks))) if kept else 1.0,
        "decode_steps": len(kept),
        "kv_bytes": float(kv_bytes),
        "mean_logprob": float(np.mean(out.logprob)) if n else 0.0,
        # Each token's model log-probability: where two runs part, how likely the draws were.
        "logprob": [round(float(x), 4) for x in out.logprob],
        # The per-token traces the plots draw.
        "traces": {f: [round(float(x), 4) for x in getattr(out, f)] for f in DEFAULT_FIELDS}
        | {"kept_fraction": [round(k / b, 4) for k, b in zip(kept, blocks, strict=True)]},
    }


def shared_keys(out: SequenceOutput, cost: CostModel) -> float:
    """Keys (averaged over the layers, as `CostModel.layer_keys`) that `out`'s decode steps
    did not read for themselves: the blocks of a shared prefix read once for every row of
    its group, less this row's share (`SequenceOutput.shared_blocks`). Only global layers
    read a prefix in a shared pass."""
    shared_layers = (cost.num_layers - cost.num_local_layers) / cost.num_layers
    return float(np.sum(out.shared_blocks)) * cost.page_size * shared_layers


def summarise(run: dict) -> dict:
    """The run-level figures of one `measure` record."""
    reqs = run["requests"]
    latency = np.array([r["end_to_end_latency"] for r in reqs])
    tokens = sum(r["generated_tokens"] for r in reqs)
    steps = sum(r["decode_steps"] for r in reqs)
    drafted = [r.get("drafted_tokens", 0.0) for r in reqs]
    # The counts of what drafting did (engine metrics; a record from before them has ratios).
    passes = sum(
        r.get("model_passes", r.get("passes_per_token", 1.0) * r["generated_tokens"]) for r in reqs
    )
    accepted = sum(
        r.get("accepted_tokens", r.get("acceptance_rate", 0.0) * d)
        for r, d in zip(reqs, drafted, strict=True)
    )
    verify_steps = sum(r.get("verify_steps", 0.0) for r in reqs)
    return {
        "throughput_tok_s": run["throughput_tok_s"],
        "latency_mean_s": float(latency.mean()),
        "latency_p50_s": float(np.percentile(latency, 50)),
        "latency_p99_s": float(np.percentile(latency, 99)),
        "ttft_mean_s": float(np.mean([r["time_to_first_token"] for r in reqs])),
        "dtau_dc_per_gb": 1e9
        * sum(r["tau"] for r in reqs)
        / max(sum(r["cost_bytes"] for r in reqs), 1.0),
        # Token-weighted: the fraction of all decode steps' blocks that were read.
        "kept_fraction": float(
            sum(r["kept_fraction"] * r["decode_steps"] for r in reqs) / max(steps, 1)
        ),
        "kv_mb_per_token": sum(r["kv_bytes"] for r in reqs) / max(tokens, 1) / 1e6,
        "host_ms_per_step": run["host_ms_per_step"],
        "compile_s": run.get("compile_s", 0.0),
        "preemptions": int(sum(r["preemptions"] for r in reqs)),
        # Speculation: model passes per generated token over the run (1 without it) and the
        # fraction of drafted tokens accepted (0 when nothing was drafted).
        "passes_per_token": passes / max(tokens, 1),
        "acceptance_rate": accepted / max(sum(drafted), 1.0),
        # Drafted tokens accepted per pass that verified drafts.
        "mean_accepted_length": accepted / max(verify_steps, 1.0),
        # The run's totals: tokens drafted and accepted, verifying passes, decode passes.
        "drafted_tokens": float(sum(drafted)),
        "accepted_tokens": float(accepted),
        "verify_steps": float(verify_steps),
        "model_passes": float(passes),
    } | _cost_per_token(run, tokens, sum(drafted))


def _cost_per_token(run: dict, tokens: int, drafted: float) -> dict:
    # Bytes and FLOPs per generated token: the weights once per model pass (shared by the
    # pass's rows), the KV each token's pass read, the products for every token run (drafts
    # included) and attention over the keys read. What etjax/bench/accelerators.py models.
    cost = run.get("cost")
    if cost is None:  # a record from before these figures
        return {}
    tokens = max(tokens, 1)
    # Attention's FLOPs count every key attended, a shared prefix's for each of its rows.
    keys = sum(
        r.get("keys_attended", r["kv_bytes"] / cost["kv_bytes_per_key"]) for r in run["requests"]
    )
    flops = cost["matmul_flops_per_token"] * (tokens + drafted)
    flops += cost["attention_flops_per_key"] * keys
    return {
        "weight_mb_per_token": cost["weight_bytes"] * run["model_passes"] / tokens / 1e6,
        "gflop_per_token": flops / tokens / 1e9,
    }
