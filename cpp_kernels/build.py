"""The C++ kernels' library: built on first use, verified, loaded, registered with XLA.

Every source defines one XLA FFI target (targets.py: its name, handler symbol and source,
defined once). `ragged_pass.cc` (dense ragged passes), `block_sparse.cc` (pruned decode),
`page_bounds.cc` (the pages' Quest bounds pruned decode ranks them by) and `select_blocks.cc`
(its kept blocks) read the KV pages (and bounds) where they lie, which XLA:CPU cannot
(ragged_pass.cc's header says why that matters); `row_products.cc` runs projections of a few
rows and `grouped_products.cc` the routed experts' grouped products, both with
`row_blocks.h`'s micro-kernel, as does `block_products.cc` (rows times quantized weight
blocks, with `block_rows.h`, which `grouped_products.cc` shares for experts kept in blocks);
all share `kernel_math.h`. Their Python wrappers sit beside the
other implementations of each op (pallas_kernels/<op>/cpu.py). They are compiled into one
library, once per machine, with the C++
compiler at hand (`CXX`, else g++, c++ or clang++) for this CPU (`-march=native`), and cached
under `$ETJAX_KERNEL_CACHE` (default `$XDG_CACHE_HOME/etjax/kernels`, that is
`~/.cache/etjax/kernels` unless set), keyed by the sources, the flags, the compiler, jaxlib and
the CPU's flags, so a copy built for another machine is never loaded. Without a compiler (or
with `ETJAX_CPU_KERNEL=0`) the engine runs the XLA kernels, after one warning.

A cached library is code this process runs, so it is loaded only when it passes the checks in
docs/RELIABILITY.md ("The kernel cache"): a private folder, a private file, and the sha256 and
size its manifest (`attention_cpu-KEY.json`, written after the library) recorded at build
time. One that fails is rebuilt; when that fails too, or the compiler outlasts
`$ETJAX_KERNEL_BUILD_TIMEOUT` seconds (default 120), the XLA kernels run after one warning.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import json
import logging
import os
import pathlib
import shutil
import signal
import stat
import subprocess
import tempfile
from collections.abc import Mapping

import jax

from cpp_kernels.targets import TARGETS, Target

HERE = pathlib.Path(__file__).parent
SOURCES = tuple(HERE / target.source for target in TARGETS)
HEADERS = tuple(
    HERE / name
    for name in ("kernel_math.h", "ragged_pass.h", "wide_tiles.h", "row_blocks.h", "block_rows.h")
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
TIMEOUT_ENV = "ETJAX_KERNEL_BUILD_TIMEOUT"
# A cold build takes about 3 s on one core; 120 s leaves room for a loaded machine.
DEFAULT_TIMEOUT_S = 120.0
# `--version` answers at once; a compiler that does not within this is not one to build with.
VERSION_TIMEOUT_S = 30.0
MANIFEST_BYTES = 64 * 1024  # far above a real manifest; a bigger file is not ours

_log = logging.getLogger("etjax")


class _Unusable(Exception):
    """The library cannot be had: `path` (or None) and why. The XLA kernels run instead."""

    def __init__(self, path: pathlib.Path | None, reason: str):
        super().__init__(f"{path}: {reason}" if path else reason)
        self.reason = reason


class _Untrusted(Exception):
    """A cached library or its manifest failed a check: it is not loaded, it is rebuilt."""


class _NoManifest(_Untrusted):
    """A library without a manifest: an older etjax's build, or one whose manifest is being
    written now. Rebuilt like any other, without alarm."""


def cpu_kernels_available() -> bool:
    """Whether the CPU kernels are built and registered with XLA (building them on the first
    call of a process, or loading the copy built earlier on this machine)."""
    return _registered()


@functools.cache
def _registered() -> bool:
    if os.environ.get("ETJAX_CPU_KERNEL", "1") == "0":
        return False
    handlers = _load_handlers()
    if handlers is None:
        return False
    for target, handler in handlers.items():
        jax.ffi.register_ffi_target(target, handler, platform="cpu")
    return True


def _load_handlers() -> dict | None:
    # Every FFI handler of the verified library, by target; None, after one warning naming
    # the file and why, when the library cannot be built, verified or loaded.
    try:
        library, path = _library()
        try:
            return {
                target.name: jax.ffi.pycapsule(getattr(library, target.symbol))
                for target in TARGETS
            }
        except AttributeError as error:  # a library of another build, or broken sources
            raise _Unusable(path, f"lacks a kernel: {error}") from error
    except _Unusable as error:
        _log.warning(
            "etjax: the CPU attention kernels could not be built or loaded (%s); decode "
            "attention runs the slower XLA loops",
            error,
        )
        return None


def _library() -> tuple[ctypes.CDLL, pathlib.Path]:
    # The loaded library and its path: the cached one if it passes its checks, else a fresh
    # build. Raises _Unusable.
    compiler = _compiler()
    timeout = _build_timeout()
    version = _run(
        [compiler, "--version"], min(timeout, VERSION_TIMEOUT_S), f"`{compiler} --version`"
    )
    key = _source_key(version)
    cache = kernel_cache_dir()
    _private_folder(cache)
    library = cache / f"attention_cpu-{key}.so"
    manifest = library.with_suffix(".json")
    distrust = None
    if os.path.lexists(library) or os.path.lexists(manifest):
        try:
            return _load_verified(library, manifest, key, version), library
        except _Untrusted as error:
            distrust = error
    try:
        _build(compiler, version, key, library, manifest, timeout)
    except _Unusable as error:
        if distrust is None:
            raise
        raise _Unusable(library, f"{distrust}, and rebuilding it failed: {error.reason}") from error
    if distrust is not None:
        (_log.info if isinstance(distrust, _NoManifest) else _log.warning)(
            "etjax: %s was not loaded (%s); rebuilt it", library, distrust
        )
    try:
        return _load_verified(library, manifest, key, version), library
    except _Untrusted as error:  # changed under us since we built it
        raise _Unusable(library, str(error)) from error


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    raise _Unusable(None, "no C++ compiler found (set CXX)")


def _build_timeout() -> float:
    text = os.environ.get(TIMEOUT_ENV, "")
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:  # also NaN
        raise _Unusable(None, f"{TIMEOUT_ENV}={text!r} is not a positive number of seconds")
    return seconds


def _run(command: list[str], timeout: float, what: str) -> str:
    # The command's stdout. A command that fails or outlasts `timeout` raises _Unusable saying
    # `what` failed; on a timeout its whole process group is killed (a compiler driver leaves
    # cc1plus and ld running otherwise).
    try:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
    except OSError as error:
        raise _Unusable(None, f"cannot run {command[0]}: {error}") from error
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(process)
        raise _Unusable(
            None, f"{what} did not finish within {timeout:g} s ({TIMEOUT_ENV} sets the limit)"
        ) from None
    except BaseException:  # Ctrl-C: the compiler runs in its own session, it must not outlive us
        _kill_group(process)
        raise
    if process.returncode != 0:
        raise _Unusable(None, f"{what} exited with {process.returncode}: {stderr.strip()[-600:]}")
    return stdout


def _kill_group(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):  # the group is gone already
        os.killpg(process.pid, signal.SIGKILL)
    process.communicate()


def _cpu_flags() -> str:
    try:
        info = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    lines = [line for line in info.splitlines() if line.startswith(("flags", "model name"))]
    return "\n".join(sorted(set(lines)))


def _source_key(version: str) -> str:
    return hashlib.sha256(
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


def kernel_cache_dir(environ: Mapping[str, str] = os.environ) -> pathlib.Path:
    """Where built libraries are kept: `$ETJAX_KERNEL_CACHE`, else `etjax/kernels` in the
    user's cache folder (`$XDG_CACHE_HOME`, default `~/.cache`), beside the compiled programs'
    cache (etjax/compilation_cache.py)."""
    if environ.get("ETJAX_KERNEL_CACHE"):
        return pathlib.Path(environ["ETJAX_KERNEL_CACHE"])
    home = environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(home) / "etjax" / "kernels"


def _private_folder(folder: pathlib.Path) -> None:
    # Makes `folder` and its missing parents 0700 whatever the umask (XDG asks the same of
    # ~/.cache); raises _Unusable when it is not a folder of this user that only they can
    # write to: anyone else who can write there can swap the library we load.
    missing = []
    parent = folder
    while not os.path.lexists(parent) and parent != parent.parent:
        missing.append(parent)
        parent = parent.parent
    try:
        for path in reversed(missing):
            try:
                os.mkdir(path, 0o700)
            except FileExistsError:  # another process made it first
                continue
            os.chmod(path, 0o700)  # mkdir's mode went through the umask
        status = os.stat(folder)
    except OSError as error:
        raise _Unusable(folder, f"cannot make the kernel cache folder: {error}") from error
    if not stat.S_ISDIR(status.st_mode):
        raise _Unusable(folder, "the kernel cache is not a folder")
    try:
        _check_private(status, "the kernel cache folder")
    except _Untrusted as error:
        raise _Unusable(folder, f"{error}; make it yours alone (chmod 700) or remove it") from None


def _check_private(status: os.stat_result, what: str) -> None:
    if status.st_uid != os.geteuid():
        raise _Untrusted(f"{what} is owned by uid {status.st_uid}, not this user ({os.geteuid()})")
    if status.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise _Untrusted(
            f"{what} is writable by group or others (mode {stat.S_IMODE(status.st_mode):o})"
        )


def _load_verified(
    library: pathlib.Path, manifest: pathlib.Path, key: str, version: str
) -> ctypes.CDLL:
    # Loads `library` if it and its manifest pass every check, else raises _Untrusted (rebuild
    # it); raises _Unusable when a verified library will not load.
    record = _read_manifest(manifest)
    expected = {"library": library.name, "key": key, "compiler": version}
    for field, value in expected.items():
        if record.get(field) != value:
            raise _Untrusted(f"its manifest {manifest.name} is for another build ({field})")
    descriptor = _verified_descriptor(library, record)
    # dlopen reads the descriptor the hash read, so a file swapped in since is not what runs.
    # It stays open while the process lives: glibc hands back an object already loaded under
    # the same name, and "/proc/self/fd/N" names another file once N is closed and reused.
    name = f"/proc/self/fd/{descriptor}"
    try:
        return ctypes.CDLL(name if os.path.exists(name) else str(library))
    except OSError as error:
        os.close(descriptor)
        raise _Unusable(library, f"cannot be loaded: {error}") from error


def _verified_descriptor(library: pathlib.Path, record: dict) -> int:
    # An open descriptor of `library` when it is a private regular file with the manifest's
    # size and sha256; raises _Untrusted otherwise.
    try:
        descriptor = os.open(library, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as error:  # missing, or a symbolic link (ELOOP)
        raise _Untrusted(f"cannot open it: {error.strerror}") from error
    try:
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode):
            raise _Untrusted("not a regular file")
        _check_private(status, "the library")
        if status.st_size != record.get("size"):
            raise _Untrusted(
                f"{status.st_size} bytes where its manifest recorded {record.get('size')}"
            )
        if _sha256(descriptor) != record.get("sha256"):
            raise _Untrusted("its sha256 differs from the one its manifest recorded")
    except BaseException:
        os.close(descriptor)
        raise
    return descriptor


def _read_manifest(manifest: pathlib.Path) -> dict:
    try:
        descriptor = os.open(manifest, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise _NoManifest(f"no manifest beside it ({manifest.name})") from None
    except OSError as error:
        raise _Untrusted(f"cannot open its manifest {manifest.name}: {error.strerror}") from None
    with os.fdopen(descriptor, "rb") as file:
        status = os.fstat(file.fileno())
        if not stat.S_ISREG(status.st_mode):
            raise _Untrusted(f"its manifest {manifest.name} is not a regular file")
        _check_private(status, f"its manifest {manifest.name}")
        text = file.read(MANIFEST_BYTES + 1)
    try:
        record = json.loads(text) if len(text) <= MANIFEST_BYTES else None
    except ValueError:  # also bytes that are not UTF-8
        record = None
    if not isinstance(record, dict):
        raise _Untrusted(f"its manifest {manifest.name} is not a JSON object")
    return record


def _sha256(descriptor: int) -> str:
    digest = hashlib.sha256()
    os.lseek(descriptor, 0, os.SEEK_SET)
    while chunk := os.read(descriptor, 1 << 20):
        digest.update(chunk)
    return digest.hexdigest()


def _build(
    compiler: str,
    version: str,
    key: str,
    library: pathlib.Path,
    manifest: pathlib.Path,
    timeout: float,
) -> None:
    # Compiles into a private scratch folder beside the cache's files, then renames the
    # library and, after it, its manifest into place: a reader never sees half a file, and a
    # library whose manifest is missing or stale is never trusted. Raises _Unusable.
    try:
        with tempfile.TemporaryDirectory(dir=library.parent, prefix=".build-") as scratch:
            partial = pathlib.Path(scratch) / library.name
            command = [
                compiler,
                *FLAGS,
                f"-I{jax.ffi.include_dir()}",
                *map(str, SOURCES),
                "-o",
                str(partial),
            ]
            try:
                _run(command, timeout, f"the build with {compiler}")
            except _Unusable as error:
                raise _Unusable(library, error.reason) from None
            os.chmod(partial, 0o700)  # the compiler's mode went through the umask
            with open(partial, "rb") as file:
                os.fsync(file.fileno())  # on disk before it is named, or a crash leaves a stub
                record = {
                    "library": library.name,
                    "sha256": _sha256(file.fileno()),
                    "size": os.fstat(file.fileno()).st_size,
                    "key": key,
                    "compiler": version,
                }
            note = pathlib.Path(scratch) / manifest.name
            _write_private(note, json.dumps(record, indent=1).encode())
            os.replace(partial, library)
            os.replace(note, manifest)
            _sync_folder(library.parent)
    except OSError as error:
        raise _Unusable(library, f"cannot write the kernel cache: {error}") from error


def _write_private(path: pathlib.Path, data: bytes) -> None:
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    with os.fdopen(descriptor, "wb") as file:
        os.fchmod(file.fileno(), 0o600)  # open's mode went through the umask
        file.write(data)
        file.flush()
        os.fsync(file.fileno())


def _sync_folder(folder: pathlib.Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def call_cpu_kernel(target: Target, results, *args, **attributes):
    """`jax.ffi.ffi_call` of one of the library's targets (targets.py) on `args`, integer
    arrays as int32 (the kernels' index type); raises RuntimeError, naming why, when the
    library is not built."""
    if not cpu_kernels_available():
        raise RuntimeError("the CPU kernels are not built (see the log's warning)")
    import jax.numpy as jnp

    args = [
        jnp.asarray(a, jnp.int32) if jnp.issubdtype(jnp.result_type(a), jnp.integer) else a
        for a in args
    ]
    return jax.ffi.ffi_call(target.name, results)(*args, **attributes)
