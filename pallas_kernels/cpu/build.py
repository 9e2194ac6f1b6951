"""The CPU kernels' library: built on first use, loaded, registered with XLA.

`ragged_pass.cc` (dense decode passes, pallas_kernels/ragged_attention/cpu.py),
`block_sparse.cc` (pruned decode), `page_bounds.cc` (the pages' Quest bounds pruned decode
ranks them by) and `select_blocks.cc` (its kept blocks; the last three in
pallas_kernels/block_sparse/cpu.py) read the KV pages (and bounds) where
they lie, which XLA:CPU cannot (ragged_pass.cc's header says why that matters);
`row_products.cc` runs projections of a few rows and `grouped_products.cc` the routed
experts' grouped products (etjax/model/products.py), both with `row_blocks.h`'s micro-kernel;
all share `kernel_math.h`. They are compiled into one library, once per machine, with the C++
compiler at hand (`CXX`, else g++, c++ or clang++) for this CPU (`-march=native`), and cached
under `$ETJAX_KERNEL_CACHE` (default `~/.cache/etjax/kernels`), keyed by the sources, the
flags, the compiler, jaxlib and the CPU's flags, so a copy built for another machine is never
loaded. Without a compiler (or with `ETJAX_CPU_KERNEL=0`) the engine runs the XLA kernels,
after one warning.
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

# The FFI targets the library registers, by the handler symbol each is bound to.
TARGETS = {
    "etjax_ragged_pass_cpu": "EtjaxRaggedPassCpu",
    "etjax_block_sparse_cpu": "EtjaxBlockSparseCpu",
    "etjax_page_bounds_cpu": "EtjaxPageBoundsCpu",
    "etjax_select_blocks_cpu": "EtjaxSelectBlocksCpu",
    "etjax_row_products_cpu": "EtjaxRowProductsCpu",
    "etjax_grouped_products_cpu": "EtjaxGroupedProductsCpu",
}
HERE = pathlib.Path(__file__).parent
SOURCES = tuple(
    HERE / name
    for name in (
        "ragged_pass.cc",
        "block_sparse.cc",
        "page_bounds.cc",
        "select_blocks.cc",
        "row_products.cc",
        "grouped_products.cc",
    )
)
HEADERS = tuple(
    HERE / name for name in ("kernel_math.h", "ragged_pass.h", "wide_tiles.h", "row_blocks.h")
)
# Associative float arithmetic lets the compiler vectorise the dot products' sums (the
# kernel's accuracy is that of a blocked sum, as XLA's own products have); no -ffast-math,
# whose finite-only assumption would break the masked scores' -1e30 handling. Multiply-adds
# fused (ISO C++ modes leave them apart), which the products' micro-kernels are made of.
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
    "-ffp-contract=fast",
)

_log = logging.getLogger("etjax")


def cpu_kernels_available() -> bool:
    """Whether the CPU kernels are built and registered with XLA (building them on the first
    call of a process, or loading the copy built earlier on this machine)."""
    return _registered()


@functools.cache
def _registered() -> bool:
    if os.environ.get("ETJAX_CPU_KERNEL", "1") == "0":
        return False
    try:
        library = ctypes.cdll.LoadLibrary(str(_built_library()))
    except (OSError, subprocess.CalledProcessError, RuntimeError) as error:
        if isinstance(error, subprocess.CalledProcessError):
            error = f"{error}: {error.stderr.strip()[-600:]}"
        _log.warning(
            "etjax: the CPU attention kernels could not be built (%s); decode attention runs "
            "the slower XLA loops",
            error,
        )
        return False
    for target, symbol in TARGETS.items():
        handler = jax.ffi.pycapsule(getattr(library, symbol))
        jax.ffi.register_ffi_target(target, handler, platform="cpu")
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
            [
                *(path.read_text() for path in (*SOURCES, *HEADERS)),
                " ".join(FLAGS),
                version,
                jax.lib.__version__,
                _cpu_flags(),
            ]
        ).encode()
    ).hexdigest()[:16]
    cache = pathlib.Path(
        os.environ.get("ETJAX_KERNEL_CACHE") or pathlib.Path.home() / ".cache/etjax/kernels"
    )
    library = cache / f"attention_cpu-{key}.so"
    if library.exists():
        return library
    cache.mkdir(parents=True, exist_ok=True)
    # Built beside its final name and renamed, so concurrent processes never load half a file.
    with tempfile.TemporaryDirectory(dir=cache) as scratch:
        partial = pathlib.Path(scratch) / library.name
        command = [
            compiler,
            *FLAGS,
            f"-I{jax.ffi.include_dir()}",
            *map(str, SOURCES),
            "-o",
            str(partial),
        ]
        subprocess.run(command, capture_output=True, text=True, check=True)
        os.replace(partial, library)
    return library


def call_cpu_kernel(target: str, results, *args, **attributes):
    """`jax.ffi.ffi_call` of one of the library's targets (TARGETS) on `args`, integer
    arrays as int32 (the kernels' index type); raises RuntimeError, naming why, when the
    library is not built."""
    if not cpu_kernels_available():
        raise RuntimeError("the CPU attention kernels are not built (see the log's warning)")
    import jax.numpy as jnp

    args = [
        jnp.asarray(a, jnp.int32) if jnp.issubdtype(jnp.result_type(a), jnp.integer) else a
        for a in args
    ]
    return jax.ffi.ffi_call(target, results)(*args, **attributes)
