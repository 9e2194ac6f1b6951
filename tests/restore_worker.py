"""Convert a model to an etjax checkpoint (`etjax convert`), restore it onto a 2x4 mesh of
forced CPU devices and report its layout.

Run by tests/test_distributed.py with 8 forced devices, beside its other workers:

    python -m tests.restore_worker MODEL_DIR CHECKPOINT_DIR

Prints on its last line, per weight kind, the shard shape each device holds and whether the
values equal a one-device restore.
"""

from __future__ import annotations

import json
import sys

import jax
import numpy as np


def main() -> None:
    import etjax
    from etjax.cli import main as cli

    source, path = sys.argv[1:]
    assert cli(["convert", source, path]) == 0
    sharded = etjax.load_model(path, mesh="2x4")
    plain = etjax.load_model(path)
    layer, ref = sharded.weights.layers[0], plain.weights.layers[0]
    report = {}
    for name, got, want in [
        ("embed", sharded.weights.embed, plain.weights.embed),
        ("wqkv", layer.wqkv, ref.wqkv),
        ("w_down", layer.w_down, ref.w_down),
        ("attn_norm", layer.attn_norm, ref.attn_norm),
    ]:
        report[name] = {
            "full": list(got.shape),
            "shards": sorted({tuple(s.data.shape) for s in got.addressable_shards}),
            "devices": len(got.sharding.device_set),
            "equal": bool(np.array_equal(np.asarray(got), np.asarray(want))),
        }
    print(json.dumps({"devices": jax.device_count(), "weights": report}))


if __name__ == "__main__":
    main()
