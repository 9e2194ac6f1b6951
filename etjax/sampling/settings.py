"""Per-request sampler settings (host side, validated) and their batched device form."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from etjax.entropy.controller import ControllerParams
from etjax.errors import FieldError

# The order is the integer code each row carries on device.
SAMPLERS = ("standard", "mirostat_v2", "edt", "entropic")
STANDARD, MIROSTAT_V2, EDT, ENTROPIC = range(len(SAMPLERS))


@dataclass(frozen=True)
class SamplerSettings:
    """How one request picks its tokens.

    sampler: "standard" (temperature + filters), "mirostat_v2" (Basu et al. 2021: truncate
      tokens whose surprise exceeds mu, steer mu to `mirostat_tau` bits), "edt" (Zhang et al.
      2024: T = edt_t0 * edt_base ** (edt_theta / H)), or "entropic" (etjax's controller holding
      the sampling entropy at `target_entropy`, docs/STABILITY.md).
    target_from_temperature: "entropic" holds, instead of `target_entropy`, the running mean
      of the entropy its own `temperature` would give this request's tokens (its middle-band
      steps so far): the level that temperature has on this text, with less spread around it.
      One fixed target is right for one kind of text only (etjax/entropy/controller.py).
    temperature: 0 = greedy for "standard"; the starting temperature for "entropic"; the
      temperature applied before truncation for "mirostat_v2".
    top_k (0 = off), top_p and typical_p (1 = off), min_p (0 = off): truncation filters,
      applied after the temperature, in that order, to every sampler.
    repetition_penalty (1 = off; divides positive / multiplies negative logits of tokens in the
      prompt or output), presence_penalty and frequency_penalty (0 = off; subtracted per token
      generated so far, once or per occurrence).
    seed: a request samples the same tokens alone or batched with others.
    """

    sampler: str = "standard"
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    edt_t0: float = 1.0
    edt_theta: float = 1.0
    edt_base: float = 0.8
    target_entropy: float = 2.0
    t_min: float = 0.1
    t_max: float = 2.0
    gain: float = 0.05
    max_step: float = 0.25
    entropy_floor: float = 0.3
    target_from_temperature: bool = False

    def __post_init__(self) -> None:
        _check(self.sampler in SAMPLERS, "sampler", self.sampler, f"one of {SAMPLERS}")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "sampler":
                continue
            if f.type == "bool":  # a switch (annotations are strings in this module)
                _check(isinstance(value, bool), f.name, value, "true or false")
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise FieldError(f.name, value, "a number")
            if isinstance(value, float) and not math.isfinite(value):
                raise FieldError(f.name, value, "finite")
        _check(self.temperature >= 0, "temperature", self.temperature, ">= 0 (0 = greedy)")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", self.top_k, "an int >= 0")
        _check(0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        _check(0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1]")
        _check(0 < self.typical_p <= 1, "typical_p", self.typical_p, "in (0, 1]")
        _check(self.repetition_penalty > 0, "repetition_penalty", self.repetition_penalty, "> 0")
        _check(
            isinstance(self.seed, int) and 0 <= self.seed < 2**32,
            "seed",
            self.seed,
            "an int in [0, 2**32)",
        )
        _check(self.mirostat_tau > 0, "mirostat_tau", self.mirostat_tau, "> 0 (bits)")
        _check(self.mirostat_eta > 0, "mirostat_eta", self.mirostat_eta, "> 0")
        _check(self.edt_t0 > 0, "edt_t0", self.edt_t0, "> 0")
        _check(0 < self.edt_base < 1, "edt_base", self.edt_base, "in (0, 1)")
        _check(self.edt_theta > 0, "edt_theta", self.edt_theta, "> 0")
        _check(self.target_entropy >= 0, "target_entropy", self.target_entropy, ">= 0 (nats)")
        _check(0 < self.t_min <= self.t_max, "t_min", self.t_min, f"in (0, t_max={self.t_max}]")
        _check(self.gain >= 0, "gain", self.gain, ">= 0")
        _check(self.max_step > 0, "max_step", self.max_step, "> 0")
        _check(self.entropy_floor >= 0, "entropy_floor", self.entropy_floor, ">= 0 (nats)")

    @property
    def is_greedy(self) -> bool:
        return self.sampler == "standard" and self.temperature == 0


def _check(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise FieldError(name, value, allowed)


@flax.struct.dataclass
class SamplerParams:
    """`SamplerSettings` of every batch row as arrays, so any mix shares one compiled step."""

    kind: jax.Array  # [B] int32 index into SAMPLERS
    temperature: jax.Array  # [B] float32
    top_k: jax.Array  # [B] int32, 0 = off
    top_p: jax.Array  # [B] float32
    min_p: jax.Array  # [B] float32
    typical_p: jax.Array  # [B] float32
    repetition_penalty: jax.Array  # [B] float32
    presence_penalty: jax.Array  # [B] float32
    frequency_penalty: jax.Array  # [B] float32
    seed: jax.Array  # [B] uint32
    mirostat_tau: jax.Array  # [B] float32, bits
    mirostat_eta: jax.Array  # [B] float32
    edt_t0: jax.Array  # [B] float32
    edt_theta: jax.Array  # [B] float32
    edt_base: jax.Array  # [B] float32
    controller: ControllerParams


def pack_sampler_params(settings: Sequence[SamplerSettings], rows: int, xp=jnp) -> SamplerParams:
    """Stack settings into [rows] arrays; padding rows beyond len(settings) are greedy.

    xp=np packs host arrays: no device dispatch per field (each eager `jnp.asarray` costs
    milliseconds on the host), for a program that takes them as inputs."""
    padded = list(settings) + [SamplerSettings()] * (rows - len(settings))

    def column(name: str, dtype) -> jax.Array:
        return xp.asarray(np.array([getattr(s, name) for s in padded], dtype=dtype))

    f32 = np.float32
    # The temperature a tracking controller measures its target at (1 where it starts greedy,
    # as `initial_sampler_state` starts it).
    base_temperature = np.array([s.temperature or 1.0 for s in padded], f32)
    return SamplerParams(
        kind=xp.asarray(np.array([SAMPLERS.index(s.sampler) for s in padded], np.int32)),
        temperature=column("temperature", f32),
        top_k=column("top_k", np.int32),
        top_p=column("top_p", f32),
        min_p=column("min_p", f32),
        typical_p=column("typical_p", f32),
        repetition_penalty=column("repetition_penalty", f32),
        presence_penalty=column("presence_penalty", f32),
        frequency_penalty=column("frequency_penalty", f32),
        seed=column("seed", np.uint32),
        mirostat_tau=column("mirostat_tau", f32),
        mirostat_eta=column("mirostat_eta", f32),
        edt_t0=column("edt_t0", f32),
        edt_theta=column("edt_theta", f32),
        edt_base=column("edt_base", f32),
        controller=ControllerParams(
            target_entropy=column("target_entropy", f32),
            log_t_min=xp.log(column("t_min", f32)),
            log_t_max=xp.log(column("t_max", f32)),
            gain=column("gain", f32),
            max_step=column("max_step", f32),
            entropy_floor=column("entropy_floor", f32),
            track_base=column("target_from_temperature", bool),
            log_t_base=xp.asarray(np.log(base_temperature)),
        ),
    )
