"""`ExpertConfig`: how many routed experts a decode token runs, from the entropy signal.

The seed paper names mixture-of-experts as a place for the entropy signal. This is its
simplest honest form: the token sampled from a distribution of entropy H (the calibrated
signal pruning reads, in nats) runs `reduced_top_k` of the k experts its router ranks highest
when H < `entropy_threshold`, and all k otherwise; the kept experts' weights are rescaled to
carry what the k did (etjax/model/experts.py). A confident step is taken to need less of the
model's capacity for its next one. Prefill tokens and tokens that verify drafts run all k:
a prompt token has no previous step of its own, and a verifying row checks its drafts
against the model itself. What it costs and saves was measured on a tiny model trained here
(benchmarks/entropy_experts.py, docs/PERF.md); no real mixture-of-experts checkpoint could be
had to measure it on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from etjax.errors import FieldError
from etjax.model.config import ModelConfig


@dataclass(frozen=True)
class ExpertConfig:
    """Settings of entropy-steered experts (off by default).

    enabled: steer the number of experts of decode tokens. A model without routed experts
      refuses it (`check_model`): a run asked to save expert work on a dense model would
      otherwise report a setting that did nothing.
    entropy_threshold: nats; a token drawn from a distribution of entropy below it runs
      `reduced_top_k` experts.
    reduced_top_k: experts such a token runs, fewer than the model's `num_experts_per_tok`.
    """

    enabled: bool = False
    entropy_threshold: float = 1.0
    reduced_top_k: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise FieldError("experts.enabled", self.enabled, "true or false")
        threshold = self.entropy_threshold
        if (
            isinstance(threshold, bool)
            or not isinstance(threshold, int | float)
            or not math.isfinite(threshold)
            or threshold < 0
        ):
            raise FieldError("experts.entropy_threshold", threshold, "a finite number of nats >= 0")
        k = self.reduced_top_k
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise FieldError("experts.reduced_top_k", k, "an integer >= 1")

    def check_model(self, cfg: ModelConfig) -> None:
        """Raise `FieldError` if enabled for a model it cannot steer: one without routed
        experts, or one that runs no more than `reduced_top_k` experts a token already."""
        if not self.enabled:
            return
        if not cfg.num_experts:
            raise FieldError(
                "experts.enabled",
                True,
                f"false for a model without routed experts ({cfg.architecture}); "
                "entropy-steered experts need a mixture-of-experts model (qwen3_moe, mixtral)",
            )
        if self.reduced_top_k >= cfg.num_experts_per_tok:
            raise FieldError(
                "experts.reduced_top_k",
                self.reduced_top_k,
                f"less than the model's num_experts_per_tok={cfg.num_experts_per_tok}",
            )

    def active_k(self, signal: jax.Array, top_k: int) -> jax.Array:
        """[B] int32 experts each row's token runs, from the entropy `signal` [B] (nats) of
        the distribution it was drawn from; `top_k`: the model's k."""
        return jnp.where(signal < self.entropy_threshold, self.reduced_top_k, top_k).astype(
            jnp.int32
        )
