"""TPU topologies by name, as devices this host can compile for without having them.

With `libtpu` installed (`pip install etjax[tpu]`), JAX describes a TPU slice it does not have
(`jax.experimental.topologies.get_topology_desc`): its devices can be named in a program's
shardings, and `.compile()` runs the real TPU compiler (XLA:TPU and Mosaic for the Pallas
kernels) for them. Nothing runs; `memory_analysis()` says what each chip would hold.

A name is `v5e-N` or `v6e-N` (N chips of one host: 1, 4 or 8), or JAX's own `v5e:2x2`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import os
from dataclasses import dataclass

import jax

from etjax.errors import ConfigError

_GIB = 2**30


@dataclass(frozen=True)
class Chip:
    """A TPU generation's published per-chip figures (Google Cloud's TPU v5e and v6e
    specifications; etjax/bench/accelerators.py has the same peaks)."""

    name: str  # as JAX's topology names it: "v5e"
    hbm_bytes: int
    bandwidth: float  # HBM bytes/s
    flops: float  # dense bfloat16 FLOP/s


CHIPS = {
    "v5e": Chip("v5e", 16 * _GIB, 819e9, 197e12),
    "v6e": Chip("v6e", 32 * _GIB, 1640e9, 918e12),
}

# Chips of one host as JAX lays them out (x, y); an 8-chip host is 2x4.
_GRIDS = {1: (1, 1), 4: (2, 2), 8: (2, 4)}


# JAX's device_kind of each chip on a TPU host.
_KINDS = {"TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v6 lite": "v6e", "TPU v6e": "v6e"}


@dataclass(frozen=True)
class Topology:
    """A named slice of one host: its chip and the chips' grid; `given`: the devices of a
    real slice (`of_devices`), else the slice is described for compiling only."""

    chip: Chip
    x: int
    y: int
    given: tuple = dataclasses.field(default=(), compare=False, repr=False)

    @property
    def chips(self) -> int:
        return self.x * self.y

    @property
    def name(self) -> str:
        return f"{self.chip.name}-{self.chips}"

    @property
    def jax_name(self) -> str:
        return f"{self.chip.name}:{self.x}x{self.y}"

    @classmethod
    def parse(cls, text: str) -> Topology:
        """'v5e-1', 'v6e-8' or JAX's 'v5e:2x2' -> Topology; a ConfigError names what is
        allowed."""
        allowed = ", ".join(f"{c}-{n}" for c in CHIPS for n in _GRIDS)
        chip, sep, rest = text.lower().replace(":", "-", 1).partition("-")
        try:
            if chip not in CHIPS or not sep:
                raise ValueError
            if "x" in rest:
                x, y = (int(p) for p in rest.split("x"))
            else:
                x, y = _GRIDS[int(rest)]
            if x <= 0 or y <= 0 or x * y > 8:
                raise ValueError
        except (ValueError, KeyError):
            raise ConfigError(
                f"topology {text!r}: expected a chip and a count of one host's chips, one of "
                f"{allowed} (or JAX's CHIPxX x Y form, e.g. 'v5e:2x2')"
            ) from None
        return cls(CHIPS[chip], x, y)

    def devices(self) -> list:
        """The slice's devices: the real ones it was made of, or those of a topology
        description (for compiling only)."""
        if self.given:
            return list(self.given)
        return list(_topology(self.jax_name, self.x, self.y).devices)

    @classmethod
    def of_devices(cls, devices) -> Topology:
        """The slice these TPU devices form (an engine's own): the chip from their kind, its
        HBM what the runtime says a device can hold (`memory_stats()["bytes_limit"]`), else
        the chip's published figure; a ConfigError for a chip not in `CHIPS`."""
        devices = list(devices)
        kind = getattr(devices[0], "device_kind", "")
        name = _KINDS.get(kind)
        if name is None:
            known = ", ".join(sorted(_KINDS))
            raise ConfigError(f"device kind {kind!r}: etjax plans for {known} only")
        chip = CHIPS[name]
        try:
            stats = devices[0].memory_stats()
        except (AttributeError, RuntimeError):  # a described device holds nothing
            stats = None
        if stats and stats.get("bytes_limit"):
            chip = dataclasses.replace(chip, hbm_bytes=int(stats["bytes_limit"]))
        x, y = _GRIDS.get(len(devices), (1, len(devices)))
        return cls(chip, x, y, tuple(devices))


@functools.cache
def _topology(jax_name: str, x: int, y: int):
    check_libtpu()
    # libtpu takes a lockfile so that one process owns a host's chips; a described topology
    # touches no chip, so plans (and test runs) in several processes need not exclude each
    # other. Without this the second fails: "Internal error when accessing libtpu
    # multi-process lockfile".
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    return topologies.get_topology_desc(
        platform="tpu",
        topology_name=jax_name,
        chip_config_name="default",
        chips_per_host_bounds=(x, y, 1),
        num_slices=1,
    )


# The libtpu each jax release was built against (what `jax[tpu]` pins): another one may fail
# to load or compile differently, so it is refused, naming the one to install.
LIBTPU_FOR_JAX = {"0.10.2": "0.0.42"}


def libtpu_version() -> str | None:
    """The installed libtpu's version, None without one."""
    try:
        return importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_libtpu() -> None:
    """Raise ConfigError, saying what to install, when libtpu is missing or does not match the
    installed jax."""
    want = LIBTPU_FOR_JAX.get(jax.__version__)
    have = libtpu_version()
    if have is None:
        pin = f'"libtpu=={want}.*"' if want else "the libtpu that jax[tpu] pins"
        raise ConfigError(
            f"compiling for a TPU needs libtpu: pip install 'etjax[tpu]' (or {pin})"
        ) from None
    if want is not None and not (have == want or have.startswith(want + ".")):
        raise ConfigError(
            f"libtpu {have} is installed but jax {jax.__version__} is built for libtpu "
            f'{want}: pip install "libtpu=={want}.*"'
        )
