"""Run one model on several meshes in a process with forced host devices; print JSON.

JAX fixes its device count when it starts, so tests/test_distributed.py runs this file in a
subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=8:

    python -m tests.mesh_worker MODEL --meshes 1x1,2x4 --new 12 [--temperatures 0,0.8]
        [--pruned-meshes 1x1,2x4] [--weights int8]

Prints {"devices": n, "outputs": {temperature: {mesh: [token ids per prompt, then the
second prompt's top-3 ids per token]}}, "experts": {mesh: {weight: layout}}, "pruned":
{mesh: outputs}} on its last line, where a layout is the shard shapes the engine placed the
first layer's router and stacked experts in and the number of devices holding them (empty
for a model without experts), and "pruned" holds the greedy outputs with pruning on, on the
pruned meshes (one process for both runs: each would start JAX and load the model).
Temperatures are request settings, not part of a program: each mesh compiles once for all
of them.
"""

from __future__ import annotations

import argparse
import json

import jax


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--meshes", default="1x1,1x8,2x4,8x1")
    parser.add_argument("--new", type=int, default=12)
    parser.add_argument("--temperatures", default="0.0")
    parser.add_argument("--pruned-meshes", default="")
    parser.add_argument("--weights", default="float32", help="the load option")
    args = parser.parse_args()

    import etjax
    from etjax.bench.corpus import lee_articles
    from etjax.pruning.config import PruningConfig

    model = etjax.load_model(args.model, weights=args.weights)
    articles = lee_articles()
    prompts = [model.tokenizer.encode(articles[i])[: 24 + 40 * i] for i in range(3)]
    # The first prompt again, drawn with another seed: it forks from the first's prefill (its
    # partly filled second page copied on whatever devices hold the pages).
    prompts.append(prompts[0])
    outputs, experts = _run_meshes(model, prompts, args.meshes, args.temperatures, args.new)
    pruned = {}
    if args.pruned_meshes:
        pruning = PruningConfig(enabled=True, min_fraction=0.3)
        pruned = _run_meshes(model, prompts, args.pruned_meshes, "0.0", args.new, pruning)[0]
    result = {"devices": jax.device_count(), "outputs": outputs, "experts": experts}
    print(json.dumps(result | {"pruned": pruned.get("0.0", {})}))


def _run_meshes(model, prompts, meshes: str, temperatures: str, new: int, pruning=None):
    # ({temperature: {mesh: outputs}}, {mesh: expert layout}) of one model on each mesh.
    from etjax.engine_build import build_engine, workload_pages
    from etjax.pruning.config import PruningConfig
    from etjax.runtime.options import RequestSettings, RuntimeOptions
    from etjax.sampling.settings import SamplerSettings

    pruning = pruning or PruningConfig()
    outputs, experts = {}, {}
    for mesh in meshes.split(","):
        options = RuntimeOptions(max_batch_size=4, mesh=mesh, pruning=pruning)
        for temperature in temperatures.split(","):
            settings = [
                RequestSettings(
                    new,
                    ignore_eos=True,
                    logprobs=3 if i == 1 else 0,  # the top-k under a vocabulary split too
                    sampler=SamplerSettings(temperature=float(temperature), seed=i),
                )
                for i in range(len(prompts))
            ]
            # generate_ids, keeping the engine to read where it placed the weights.
            pages = workload_pages(prompts, settings, options)
            engine = build_engine(model.weights, model.config, model.tokenizer, options, pages)
            outs = engine.generate(prompts, settings)
            top_ids = [[t for t, _ in top] for top in outs[1].top_logprobs]
            outputs.setdefault(temperature, {})[mesh] = [o.token_ids for o in outs] + [top_ids]
        experts[mesh] = expert_layout(engine.backend.weights.layers[0])
    return outputs, experts


def expert_layout(layer) -> dict:
    """{weight: {"shards": shard shapes, "devices": n}} of a layer's router and experts (kept
    quantized: of their quants)."""
    layout = {}
    for name in ("router", "experts_gate_up", "experts_down"):
        weight = getattr(layer, name, None)
        weight = getattr(weight, "quants", weight)
        if weight is not None:
            layout[name] = {
                "shards": sorted({tuple(s.data.shape) for s in weight.addressable_shards}),
                "devices": len(weight.sharding.device_set),
            }
    return layout


if __name__ == "__main__":
    main()
