"""Run models' forward pass on a mesh of forced host devices, as the engine's ragged step does;
save the logits.

JAX fixes its device count when it starts, so tests/test_distributed.py runs this file in a
subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=8:

    python -m tests.family_mesh_worker MESH MODEL_DIR [MODEL_DIR ...]

One process for several models, and one compiled program per model: tests/mesh_worker.py runs
the whole engine, its prefill and decode programs compiled on one device and again on the mesh,
which for one tiny dense model took 19-29 s where this took 11 s for three (2-core CPU, load
average 5, 2026-12-05); the suite has seconds for this, not a minute.

For each model it writes MODEL_DIR/mesh-MESH.npz: `ids` [2, S] (each row padded with -1) and
`logits` [2, S, V] (NaN where padded), for the caller to hold against its own reference, and
prints {"devices": n, "layouts": {MODEL_DIR: {array: shard shape}}} on its last line.

Both rows run through the paged cache in two ragged steps of the same program, the engine's
mix: step 1 prefills a chunk of each row; step 2 decodes row 0's next token (a one-token
decode segment) beside row 1's second chunk, which attends to the keys step 1 cached. The
weights and KV pages are placed as the engine places them (etjax/distributed/placement.py:
split over `model`), and the flat tokens are split over `data`.
"""

from __future__ import annotations

import argparse
import json

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

PAGE_SIZE = 16
STEP_TOKENS = 48  # both steps' flat batch, padded (a multiple of the data axis)
# (row, cached tokens, new tokens) of each step: row 0 prefills 24 tokens, then decodes one;
# row 1 prefills 17, then 20 more after them (across a page boundary and past the window).
STEPS = (((0, 0, 24), (1, 0, 17)), ((0, 24, 1), (1, 17, 20)))
ROW_PAGES = 3  # 48 positions per row at most


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mesh")
    parser.add_argument("models", nargs="+")
    args = parser.parse_args()
    layouts = {directory: run_model(directory, args.mesh) for directory in args.models}
    print(json.dumps({"devices": jax.device_count(), "layouts": layouts}))


def run_model(directory: str, mesh: str) -> dict:
    """Run the two steps of one model on `mesh`, save its ids and logits; return the shard
    shapes of its first layer's fused q|k|v, its embedding and its KV pages."""
    import etjax
    from etjax.attention import PlanSizes, plan_segments
    from etjax.cache.kv_cache import init_kv_cache
    from etjax.distributed.mesh import DATA, MeshShape, make_mesh
    from etjax.distributed.placement import Placement
    from etjax.model.transformer import forward, logits_from_hidden
    from pallas_kernels.ragged_attention.work_items import Segment

    model = etjax.load_model(directory, dtype="float32", mesh=mesh)  # placed as it loads
    weights, cfg = model.weights, model.config
    placement = Placement(make_mesh(MeshShape.parse(mesh)))  # the same devices, for the rest
    rows, num_pages = 2, 1 + 2 * ROW_PAGES
    table = 1 + np.arange(rows * ROW_PAGES, dtype=np.int32).reshape(rows, ROW_PAGES)
    cache = placement.place_cache(init_kv_cache(cfg, num_pages, PAGE_SIZE))
    sizes = PlanSizes(
        PAGE_SIZE,
        PlanSizes.decode(rows, num_pages, PAGE_SIZE).passes
        # The pass of short chunks only (a longer pass, compiled but idle, would cost time).
        + PlanSizes.prefill(STEP_TOKENS, rows, ROW_PAGES, PAGE_SIZE).passes[:1],
    )
    lengths = [sum(new for step in STEPS for r, _, new in step if r == row) for row in (0, 1)]
    ids = np.random.default_rng(0).integers(3, cfg.vocab_size, (rows, max(lengths)), np.int32)
    for row, length in enumerate(lengths):
        ids[row, length:] = -1
    logits = np.full((*ids.shape, cfg.vocab_size), np.nan, np.float32)
    flat = NamedSharding(placement.mesh, P(DATA))

    @jax.jit
    def step(weights, cache, tokens, positions, write_pages, plan):
        hidden, cache = forward(weights, cache, tokens, positions, write_pages, cfg, plan)
        return logits_from_hidden(weights, hidden), cache

    for step_rows in STEPS:
        tokens, positions, write_pages = (np.zeros(STEP_TOKENS, np.int32) for _ in range(3))
        segments, start = [], 0
        for row, cached, new in step_rows:
            span = slice(start, start + new)
            positions[span] = cached + np.arange(new)
            tokens[span] = ids[row, positions[span]]
            write_pages[span] = table[row, positions[span] // PAGE_SIZE]
            reach = cached + new - 1
            segments.append(
                Segment(start, new, cached, reach, table[row, : reach // PAGE_SIZE + 1].tolist())
            )
            start += new
        # A one-token segment goes to the decode pass, chunks to the prefill pass.
        plan = plan_segments(segments, STEP_TOKENS, sizes, window=cfg.attention_window)
        with placement.tracing():
            out, cache = step(
                weights,
                cache,
                *(jax.device_put(a, flat) for a in (tokens, positions, write_pages)),
                plan,
            )
        out = np.asarray(out)
        for segment, (row, cached, new) in zip(segments, step_rows, strict=True):
            logits[row, cached : cached + new] = out[
                segment.token_start : segment.token_start + new
            ]
    np.savez(f"{directory}/mesh-{mesh}.npz", ids=ids, logits=logits)
    layer = weights.layers[0]
    return {
        "wqkv": _shard_shape(layer.wqkv),
        "embed": _shard_shape(weights.embed),
        "k_pages": _shard_shape(cache.k),
    }


def _shard_shape(array: jax.Array) -> list[int]:
    return list(array.addressable_shards[0].data.shape)


if __name__ == "__main__":
    main()
