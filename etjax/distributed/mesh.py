"""The device mesh: a `data` axis over sequences (batch rows) and a `model` axis over attention
heads, MLP columns and the vocabulary.

A mesh shape is written `DATAxMODEL` ("2x4": two groups of four devices, each group holding
one copy of the weights split four ways and serving its own rows) and takes the first
DATA * MODEL devices of the process. `1x1` is one device, and etjax then places nothing
explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh

from etjax.errors import ConfigError

DATA, MODEL = "data", "model"


@dataclass(frozen=True)
class MeshShape:
    data: int = 1
    model: int = 1

    def __post_init__(self) -> None:
        for name in ("data", "model"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"mesh {name}={value!r}; must be a positive integer")

    @classmethod
    def parse(cls, text: str) -> MeshShape:
        """'2x4' -> MeshShape(data=2, model=4)."""
        parts = text.lower().split("x")
        try:
            data, model = (int(p) for p in parts)
        except ValueError:
            raise ConfigError(
                f"mesh {text!r}: expected DATAxMODEL, two positive integers such as '2x4'"
            ) from None
        return cls(data, model)

    @property
    def size(self) -> int:
        return self.data * self.model

    def __str__(self) -> str:
        return f"{self.data}x{self.model}"


def make_mesh(shape: MeshShape, devices: list | None = None) -> Mesh:
    """A (data, model) mesh over the first `shape.size` of `devices` (default: this process's
    devices, so a job's mesh stays on its own host)."""
    devices = list(jax.local_devices() if devices is None else devices)
    if shape.size > len(devices):
        raise ConfigError(
            f"mesh {shape} needs {shape.size} devices; this process has {len(devices)} "
            f"({devices[0].platform if devices else 'none'})"
        )
    chosen = np.array(devices[: shape.size]).reshape(shape.data, shape.model)
    return Mesh(chosen, (DATA, MODEL))
