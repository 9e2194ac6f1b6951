"""What a config's measured cost per token would give on an accelerator: a roofline model.

A decode step on an accelerator is bound by the bytes it reads (weights, shared by the batch's
rows, and each row's KV) or by its arithmetic, whichever takes longer at the chip's published
peak. From a run's measured bytes and FLOPs per generated token (etjax/bench/measure.py), the
model predicts tokens per second as 1 / max(bytes / bandwidth, FLOPs / peak). It is a model,
not a measurement: it ignores kernel efficiency, launch and host overheads and the batch sizes
a chip would run, and it takes the bytes in the dtype the run used (a float32 CPU run reads
twice what the same model in bfloat16 would). It tells a user which of a config's savings
(KV read, passes per token) carry over to their chip, and roughly how far.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Accelerator:
    name: str
    bandwidth: float  # bytes/s of HBM, published peak
    flops: float  # dense bfloat16 FLOP/s, published peak


# Published peaks: Google Cloud's TPU v5e and v6e (Trillium) specifications, NVIDIA's H100
# SXM data sheet (dense, without sparsity).
ACCELERATORS = (
    Accelerator("TPU v5e", 819e9, 197e12),
    Accelerator("TPU v6e", 1640e9, 918e12),
    Accelerator("H100 SXM", 3350e9, 989e12),
)


def predicted_tokens_per_s(chip: Accelerator, bytes_per_token: float, flops_per_token: float):
    """Generated tokens per second the roofline allows (see the module docstring)."""
    seconds = max(bytes_per_token / chip.bandwidth, flops_per_token / chip.flops)
    return 1.0 / seconds if seconds > 0 else float("inf")
