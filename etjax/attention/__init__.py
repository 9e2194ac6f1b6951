"""The attention seam: the model calls `attend`, the engine describes the work with a plan.

- `plan.py`: `AttentionPlan` (what a step's tokens attend to, as device arrays; under
  pruning with the rows' `SparsePlan`) and the host builders: `plan_segments` for a ragged
  batch of sequences, `plan_decode` for decode rows (reading shared prefixes once, as
  `decode_sharing` groups them), `padded_batch_plan` for a padded [rows, tokens] batch.
- `cascade.py`: `shared_prefixes`, which decode rows start with the same pages and read them
  once, stacked (cascade attention); `blocks_read_for_others`, what that spares each row.
- `backend.py`: `AttentionBackend`, the kernels a step runs and whether its decode rows prune
  (the one place that is chosen), and `resolve_backend`, which picks them by platform.
- `seam.py`: `attend`, which runs a plan's dense passes.
- `layer.py`: `attend_layer`, the model's one attention call per layer, which reads from the
  plan whether the layer's tokens attend densely, through their window or to their pruned
  blocks; `check_plans`.
- `pruned.py`: `pruned_decode_attention`, block selection by Quest bounds and the
  block-sparse kernel of the chosen backend; `kept_table_width`, the kept table's static
  width per backend.

The paged cache layout (etjax/cache/kv_cache.py) and the kernels (pallas_kernels/) sit below;
the engine and the device programs (etjax/runtime/, etjax/engine/) above.
"""

from etjax.attention.backend import BACKENDS, DENSE, XLA, AttentionBackend, resolve_backend
from etjax.attention.layer import attend_layer, check_plans
from etjax.attention.plan import (
    AttentionPlan,
    PlanSizes,
    SparsePlan,
    decode_sharing,
    padded_batch_plan,
    plan_decode,
    plan_passes,
    plan_segments,
)
from etjax.attention.pruned import kept_table_width, pruned_decode_attention
from etjax.attention.seam import attend

__all__ = [
    "BACKENDS",
    "DENSE",
    "XLA",
    "AttentionBackend",
    "AttentionPlan",
    "PlanSizes",
    "SparsePlan",
    "attend",
    "attend_layer",
    "check_plans",
    "decode_sharing",
    "kept_table_width",
    "padded_batch_plan",
    "plan_decode",
    "plan_passes",
    "plan_segments",
    "pruned_decode_attention",
    "resolve_backend",
]
