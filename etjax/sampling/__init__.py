"""The sampler suite: per-request settings, penalties, truncation filters and adaptive samplers."""

from etjax.sampling.settings import SAMPLERS, SamplerSettings

__all__ = ["SAMPLERS", "SamplerSettings"]
