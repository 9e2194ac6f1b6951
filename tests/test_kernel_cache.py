"""The C++ kernels' cache (cpp_kernels/build.py) trusts no file for its name: a
truncated, planted, swapped or world-writable library is never loaded (rebuilt, or the XLA
kernels run after one warning naming the file), a build under any umask is private, and a
compiler that never answers is stopped. No real compile here: the run compiled the kernels
at their first use (or found them compiled from the same sources), and every build here runs
a stand-in compiler that answers `--version` as the real one does (so the cache key is the
same) and "builds" by copying that library, failing, or sleeping. Every
cache is a temporary folder (ETJAX_KERNEL_CACHE), never the user's."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cpp_kernels import build
from tests.subprocess_env import subprocess_env

# A library whose constructor, if it ever ran, would leave a marker file.
PLANTED_SOURCE = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
  const char *marker = getenv("ETJAX_TEST_MARKER");
  if (marker) { FILE *file = fopen(marker, "w"); if (file) fclose(file); }
}
"""


@pytest.fixture(scope="module")
def compiler() -> str:
    """The real compiler, read before any test points CXX at a stand-in."""
    return build._compiler()


@pytest.fixture(scope="module")
def genuine(tmp_path_factory, compiler) -> Path:
    """A cache built by etjax, in a fresh process under umask 000. Its compiler is a stand-in
    whose build copies the library this run compiled from the same sources, with the mode a
    real link leaves under umask 000 (0777): the whole build path runs as for real, and the
    suite compiles the kernels once, not twice (18 s)."""
    _, library = build._library()
    folder = tmp_path_factory.mktemp("umask")
    cache = folder / "parent" / "kernels"
    copying = _compiler_script(folder, library, compiler, COPY + " && chmod 777 $out")
    env = subprocess_env() | {"ETJAX_KERNEL_CACHE": str(cache), "CXX": str(copying)}
    script = (
        "import os; os.umask(0); from cpp_kernels import cpu_kernels_available; "
        "print(cpu_kernels_available())"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True"], done.stderr
    assert _only(cache, ".so").read_bytes() == library.read_bytes()
    return cache


@pytest.fixture(scope="module")
def planted(tmp_path_factory, compiler) -> Path:
    """A shared library with a constructor and none of the kernels."""
    folder = tmp_path_factory.mktemp("planted")
    (folder / "planted.cc").write_text(PLANTED_SOURCE)
    library = folder / "planted.so"
    subprocess.run(
        [compiler, "-shared", "-fPIC", str(folder / "planted.cc"), "-o", str(library)],
        check=True,
        timeout=120,
    )
    return library


@pytest.fixture
def warnings_logged():
    """The `etjax` logger's records of this test (a handler of its own: the CLI's tests may
    have stopped the logger propagating to caplog's)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logger = logging.getLogger("etjax")
    level, logger.level = logger.level, logging.INFO
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(level)


def _only(folder: Path, suffix: str) -> Path:
    (path,) = folder.glob(f"attention_cpu-*{suffix}")
    return path


def _stand_in(
    tmp_path: Path, genuine: Path, compiler: str, build_step: str, version_step: str = ""
) -> Path:
    # A compiler script whose builds may copy the genuine cache's library.
    return _compiler_script(tmp_path, _only(genuine, ".so"), compiler, build_step, version_step)


def _compiler_script(
    tmp_path: Path, library: Path, compiler: str, build_step: str, version_step: str = ""
) -> Path:
    # A compiler script: `--version` as `compiler` answers it (after `version_step`), anything
    # else runs `build_step` ({library} is `library`), with $out the file the build must write.
    script = tmp_path / f"stand-in-{len(list(tmp_path.glob('stand-in-*')))}"
    script.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = --version ]; then\n'
        f"  {version_step}\n"
        f"  exec {compiler} --version\n"
        "fi\n"
        'while [ $# -gt 0 ]; do [ "$1" = -o ] && out=$2; shift; done\n'
        f"{build_step.format(library=library)}\n"
    )
    script.chmod(0o700)
    return script


COPY = "cp {library} $out"  # a build that yields the genuine library
FAIL = "echo 'cc1plus: out of memory' >&2; exit 1"


@pytest.fixture
def cache(tmp_path, genuine, compiler, monkeypatch) -> Path:
    """A copy of the genuine cache, named by ETJAX_KERNEL_CACHE; the compiler fails unless the
    test says otherwise."""
    copy = tmp_path / "kernels"
    shutil.copytree(genuine, copy)
    monkeypatch.setenv("ETJAX_KERNEL_CACHE", str(copy))
    monkeypatch.setenv("CXX", str(_stand_in(tmp_path, genuine, compiler, FAIL)))
    monkeypatch.setenv("ETJAX_TEST_MARKER", str(tmp_path / "marker"))
    return copy


def test_a_build_under_umask_000_is_private_and_its_manifest_true(genuine, compiler):
    for folder in (genuine.parent, genuine):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    library, manifest = _only(genuine, ".so"), _only(genuine, ".json")
    assert stat.S_IMODE(library.stat().st_mode) & 0o077 == 0
    assert stat.S_IMODE(manifest.stat().st_mode) == 0o600
    assert sorted(path.name for path in genuine.iterdir()) == [manifest.name, library.name]
    record = json.loads(manifest.read_text())
    data = library.read_bytes()
    assert record["sha256"] == hashlib.sha256(data).hexdigest()
    assert record["size"] == len(data)
    assert library.name == f"attention_cpu-{record['key']}.so"
    assert record["compiler"].startswith(
        subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    )


def test_a_truncated_library_is_rebuilt_in_a_process_that_lives(cache, genuine, compiler, tmp_path):
    # Mapping a truncated library kills the process with SIGBUS, so it runs in a child.
    library = _only(cache, ".so")
    library.write_bytes(library.read_bytes()[:100_000])
    env = subprocess_env() | {"CXX": str(_stand_in(tmp_path, genuine, compiler, COPY))}
    script = (
        "import logging; logging.basicConfig(); "
        "from cpp_kernels import cpu_kernels_available; print(cpu_kernels_available())"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True"], done.stderr
    assert done.stderr.count("WARNING") == 1, done.stderr
    assert f"{library} was not loaded (100000 bytes where its manifest recorded" in done.stderr
    assert library.read_bytes() == _only(genuine, ".so").read_bytes()


def _forge_manifest(cache: Path, library: bytes) -> None:
    # A manifest that matches `library`, as etjax would have written it.
    manifest = _only(cache, ".json")
    record = json.loads(manifest.read_text())
    record |= {"sha256": hashlib.sha256(library).hexdigest(), "size": len(library)}
    manifest.write_text(json.dumps(record))


def _no_manifest(cache, planted):
    _only(cache, ".json").unlink()
    _only(cache, ".so").write_bytes(planted.read_bytes())


def _swapped(cache, planted):
    _only(cache, ".so").write_bytes(planted.read_bytes())


def _group_writable(cache, planted):
    _swapped(cache, planted)
    _forge_manifest(cache, planted.read_bytes())
    _only(cache, ".so").chmod(0o772)


def _writable_manifest(cache, planted):
    _swapped(cache, planted)
    _forge_manifest(cache, planted.read_bytes())
    _only(cache, ".json").chmod(0o666)


def _symbolic_link(cache, planted):
    _forge_manifest(cache, planted.read_bytes())
    library = _only(cache, ".so")
    library.unlink()
    library.symlink_to(planted)


def _manifest_of_another_build(cache, planted):
    _swapped(cache, planted)
    _forge_manifest(cache, planted.read_bytes())
    manifest = _only(cache, ".json")
    manifest.write_text(manifest.read_text().replace('"key": "', '"key": "0'))


def _manifest_not_json(cache, planted):
    _swapped(cache, planted)
    _only(cache, ".json").write_bytes(b"\xff{")


@pytest.mark.parametrize(
    ("plant", "reason"),
    [
        (_no_manifest, "no manifest beside it"),
        (_swapped, "bytes where its manifest recorded"),
        (_group_writable, "the library is writable by group or others (mode 772)"),
        (_writable_manifest, "is writable by group or others (mode 666)"),
        (_symbolic_link, "cannot open it"),
        (_manifest_of_another_build, "is for another build (key)"),
        (_manifest_not_json, "is not a JSON object"),
    ],
)
def test_a_planted_library_never_runs(cache, planted, plant, reason, warnings_logged):
    # The rebuild fails (the stand-in compiler's FAIL): the XLA kernels run, after one warning
    # naming the file, why it was refused, and why it could not be rebuilt.
    plant(cache, planted)
    assert build._load_handlers() is None
    assert not (cache.parent / "marker").exists()
    (warning,) = [r.getMessage() for r in warnings_logged if r.levelno == logging.WARNING]
    assert str(_only(cache, ".so")) in warning and reason in warning, warning
    assert "rebuilding it failed" in warning and "out of memory" in warning, warning


def test_a_planted_library_is_replaced_by_a_rebuild(
    cache, genuine, compiler, planted, tmp_path, monkeypatch
):
    _swapped(cache, planted)
    monkeypatch.setenv("CXX", str(_stand_in(tmp_path, genuine, compiler, COPY)))
    assert set(build._load_handlers()) == {target.name for target in build.TARGETS}
    assert not (cache.parent / "marker").exists()
    assert _only(cache, ".so").read_bytes() == _only(genuine, ".so").read_bytes()


def test_a_cache_folder_others_can_write_to_is_refused(cache, planted, tmp_path, warnings_logged):
    # Even a library that matches its manifest: anyone could have written both.
    _swapped(cache, planted)
    _forge_manifest(cache, planted.read_bytes())
    cache.chmod(0o777)
    assert build._load_handlers() is None
    assert not (cache.parent / "marker").exists()
    (warning,) = [r.getMessage() for r in warnings_logged if r.levelno == logging.WARNING]
    assert f"{cache}: the kernel cache folder is writable by group or others (mode 777)" in warning
    assert _only(cache, ".so").read_bytes() == planted.read_bytes()  # not rebuilt either


@pytest.mark.parametrize(
    ("library", "reason"),
    [(None, "lacks a kernel"), (b"not a library\n", "cannot be loaded")],
)
def test_a_verified_library_that_will_not_load_falls_back(
    cache, planted, library, reason, monkeypatch, warnings_logged
):
    # Files that pass every check (as if etjax built them) but are not this build's library.
    monkeypatch.delenv("ETJAX_TEST_MARKER")
    data = planted.read_bytes() if library is None else library
    _only(cache, ".so").write_bytes(data)
    _forge_manifest(cache, data)
    assert build._load_handlers() is None
    (warning,) = [r.getMessage() for r in warnings_logged if r.levelno == logging.WARNING]
    assert f"{_only(cache, '.so')}: {reason}" in warning, warning


@pytest.mark.parametrize(
    ("stage", "said"), [("--version", "--version`"), ("build", "the build with")]
)
def test_a_compiler_that_never_returns_is_stopped(
    cache, genuine, compiler, tmp_path, stage, said, monkeypatch, warnings_logged
):
    # The sleep runs as the compiler's child, as cc1plus does under g++: it must die too.
    _only(cache, ".so").unlink()
    pid_file = tmp_path / "sleep.pid"
    hang = f"sleep 1000 & echo $! > {pid_file}; wait"
    steps = (FAIL, hang) if stage == "--version" else (hang, "")
    monkeypatch.setenv("CXX", str(_stand_in(tmp_path, genuine, compiler, *steps)))
    monkeypatch.setenv(build.TIMEOUT_ENV, "1")
    start = time.monotonic()
    assert build._load_handlers() is None
    assert time.monotonic() - start < 10
    (warning,) = [r.getMessage() for r in warnings_logged if r.levelno == logging.WARNING]
    assert said in warning and "did not finish within 1 s" in warning, warning
    sleeper = Path(f"/proc/{pid_file.read_text().strip()}/stat")
    deadline = time.monotonic() + 5
    while sleeper.exists() and sleeper.read_text().split()[2] != "Z":  # gone, or a zombie
        assert time.monotonic() < deadline, "the compiler's child outlived the timeout"
        time.sleep(0.05)


@pytest.mark.parametrize("value", ["abc", "0", "-5", "nan"])
def test_a_bad_build_timeout_falls_back_naming_it(cache, value, monkeypatch, warnings_logged):
    monkeypatch.setenv(build.TIMEOUT_ENV, value)
    assert build._load_handlers() is None
    (warning,) = [r.getMessage() for r in warnings_logged if r.levelno == logging.WARNING]
    assert f"{build.TIMEOUT_ENV}={value!r} is not a positive number of seconds" in warning


def test_the_cache_folder_follows_the_setting_then_the_users_cache_folder(tmp_path):
    # As the compiled programs' cache does (etjax/compilation_cache.py): ETJAX_KERNEL_CACHE,
    # else XDG_CACHE_HOME/etjax/kernels, else ~/.cache/etjax/kernels.
    own = str(tmp_path / "mine")
    assert build.kernel_cache_dir({"ETJAX_KERNEL_CACHE": own, "XDG_CACHE_HOME": "/x"}) == Path(own)
    assert build.kernel_cache_dir({"XDG_CACHE_HOME": "/x"}) == Path("/x/etjax/kernels")
    assert build.kernel_cache_dir({}) == Path.home() / ".cache" / "etjax" / "kernels"
