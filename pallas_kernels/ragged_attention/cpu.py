"""The CPU pass for narrow query tiles: cpu_kernel.cc, an XLA FFI custom call that reads the
KV pages in place (why, in that file's header), built on first use.

`ragged_pass_cpu` takes the arguments of the XLA backend's passes and returns the same
(outputs, log-sum-exps), so xla.py runs it in place of its one-token item loop when
`cpu_pass_available()`. The library is compiled once per machine with the C++ compiler at
hand (`CXX`, else g++ or c++) for this CPU (`-march=native`) and cached under
`$ETJAX_KERNEL_CACHE` (default `~/.cache/etjax/kernels`), keyed by the source, the flags, the
compiler, jaxlib and the CPU's flags, so a copy built elsewhere is never loaded. Without a
compiler (or with `ETJAX_CPU_KERNEL=0`) the XLA loop runs instead, after one warning.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.ragged_attention.work_items import TilePass

TARGET = "etjax_ragged_pass_cpu"
SOURCE = pathlib.Path(__file__).with_name("cpu_kernel.cc")
# Associative float arithmetic lets the compiler vectorise the dot products' sums (the
# kernel's accuracy is that of a blocked sum, as XLA's own products have); no -ffast-math,
# whose finite-only assumption would break the masked scores' -1e30 handling.
FLAGS = (
    "-O3",
    "-march=native",
    "-std=c++17",
    "-shared",
    "-fPIC",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fassociative-math",
    "-fno-signed-zeros",
)

_log = logging.getLogger("etjax")


def cpu_pass_available() -> bool:
    """Whether the CPU kernel is built and registered with XLA (building it on first call)."""
    return _registered()


@functools.cache
def _registered() -> bool:
    if os.environ.get("ETJAX_CPU_KERNEL", "1") == "0":
        return False
    try:
        library = ctypes.cdll.LoadLibrary(str(_built_library()))
    except (OSError, subprocess.CalledProcessError, RuntimeError) as error:
        _log.warning(
            "etjax: the CPU attention kernel could not be built (%s); decode attention runs "
            "the slower XLA loop",
            error,
        )
        return False
    handler = jax.ffi.pycapsule(library.EtjaxRaggedPassCpu)
    jax.ffi.register_ffi_target(TARGET, handler, platform="cpu")
    return True


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    raise RuntimeError("no C++ compiler found (set CXX)")


def _cpu_flags() -> str:
    try:
        info = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    lines = [line for line in info.splitlines() if line.startswith(("flags", "model name"))]
    return "\n".join(sorted(set(lines)))


def _built_library() -> pathlib.Path:
    compiler = _compiler()
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True
    ).stdout
    key = hashlib.sha256(
        "\0".join(
            [SOURCE.read_text(), " ".join(FLAGS), version, jax.lib.__version__, _cpu_flags()]
        ).encode()
    ).hexdigest()[:16]
    cache = pathlib.Path(
        os.environ.get("ETJAX_KERNEL_CACHE") or pathlib.Path.home() / ".cache/etjax/kernels"
    )
    library = cache / f"ragged_pass_cpu-{key}.so"
    if library.exists():
        return library
    cache.mkdir(parents=True, exist_ok=True)
    # Built beside its final name and renamed, so concurrent processes never load half a file.
    with tempfile.TemporaryDirectory(dir=cache) as scratch:
        partial = pathlib.Path(scratch) / library.name
        command = [compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(partial)]
        subprocess.run(command, capture_output=True, text=True, check=True)
        os.replace(partial, library)
    return library


def ragged_pass_cpu(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    q_positions: jax.Array,
    tile_pass: TilePass,
    window: jax.Array | int,
    softcap: float,
) -> tuple[jax.Array, jax.Array]:
    """One pass of ragged attention on the CPU kernel: q [T, H, hd], pools [N, KVH, ps, hd]
    (float32, float16 or bfloat16), q_positions [T], `tile_pass` as work_items.py builds it.
    Returns the tiles' outputs [Nq, Qt, H, hd] and log-sum-exps [Nq, Qt, H], float32."""
    _, h, hd = q.shape
    nq, qt = tile_pass.tile_tokens.shape
    call = jax.ffi.ffi_call(
        TARGET,
        (
            jax.ShapeDtypeStruct((nq, qt, h, hd), jnp.float32),
            jax.ShapeDtypeStruct((nq, qt, h), jnp.float32),
        ),
    )
    as_int = lambda a: jnp.asarray(a, jnp.int32)  # noqa: E731
    return call(
        q.astype(jnp.float32),
        k_pages,
        v_pages,
        as_int(q_positions),
        *(as_int(a) for a in tile_pass),
        as_int(window),
        softcap=np.float32(softcap),
        scale=np.float32(hd**-0.5),
    )
