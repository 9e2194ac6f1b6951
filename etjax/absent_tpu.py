"""Keep JAX from trying a TPU that is not there.

`pip install 'etjax[tpu]'` brings libtpu, so that any machine can compile for a TPU
(etjax/planning). Where libtpu is installed JAX tries the TPU first in every process, and on a
host without one libtpu prints a page of warnings before JAX falls back to the CPU. Unless the
user chose platforms (`JAX_PLATFORMS`), such a host is told to use its CPU, before JAX starts.
A host with TPU chips, or with a CUDA plugin for JAX installed, is left as JAX would find it.
"""

from __future__ import annotations

import glob
import importlib.util
import os
from collections.abc import MutableMapping

# Google's PCI vendor id, which a host's TPU chips carry (/sys/bus/pci/devices/*/vendor).
GOOGLE_PCI_VENDOR = "0x1ae0"
CUDA_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin")


def skip_absent_tpu(environ: MutableMapping[str, str] = os.environ) -> None:
    """Set JAX_PLATFORMS=cpu in `environ` where libtpu is installed, no platform was chosen and
    this host has neither a TPU chip nor a CUDA plugin for JAX."""
    if "JAX_PLATFORMS" in environ or importlib.util.find_spec("libtpu") is None:
        return
    if has_tpu_chips() or any(importlib.util.find_spec(p) for p in CUDA_PLUGINS):
        return
    environ["JAX_PLATFORMS"] = "cpu"


def has_tpu_chips(pattern: str = "/sys/bus/pci/devices/*/vendor") -> bool:
    """Whether a PCI device of this host is Google's (a TPU chip)."""
    for path in glob.glob(pattern):
        try:
            with open(path) as vendor:
                if vendor.read().strip() == GOOGLE_PCI_VENDOR:
                    return True
        except OSError:
            continue
    return False
