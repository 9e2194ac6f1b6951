"""The persistent compilation cache: on by default in the per-user cache directory, the
caller's own JAX setting respected, and off by an environment variable or a config key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cpp_kernels.build import kernel_cache_dir
from etjax.compilation_cache import chosen_directory
from tests.subprocess_env import subprocess_env

HOME = Path.home()


@pytest.mark.parametrize(
    "enabled, environ, configured, expected",
    [
        (True, {}, None, HOME / ".cache" / "etjax" / "xla"),
        (True, {"XDG_CACHE_HOME": "/x"}, None, Path("/x/etjax/xla")),
        (True, {"ETJAX_COMPILATION_CACHE": "/mine"}, None, Path("/mine")),
        (True, {"ETJAX_COMPILATION_CACHE": "off"}, None, None),
        (True, {"ETJAX_COMPILATION_CACHE": "0"}, None, None),
        (False, {}, None, None),
        # The caller's own JAX setting wins, whatever etjax's switches say.
        (False, {"JAX_COMPILATION_CACHE_DIR": "/j"}, None, Path("/j")),
        (True, {"ETJAX_COMPILATION_CACHE": "off"}, "/k", Path("/k")),
    ],
)
def test_the_directory_follows_the_documented_rules(enabled, environ, configured, expected):
    assert chosen_directory(enabled, environ, configured) == expected


def test_a_first_decode_fills_the_per_user_cache_unless_switched_off(tiny_hf_dir, tmp_path):
    # One token: the prefill's programs, not a decode burst's too (2 s of CPU each process).
    # The two processes share nothing (each its own XDG_CACHE_HOME): they run side by side.
    script = (
        "import sys, etjax; etjax.decode('Hi', model=sys.argv[1], max_new_tokens=1, "
        "ignore_eos=True)"
    )
    processes = {}
    for switch in ("", "off"):
        env = subprocess_env()
        del env["JAX_COMPILATION_CACHE_DIR"]
        env["XDG_CACHE_HOME"] = str(tmp_path / f"xdg{switch}")
        # The C++ kernels stay where this run keeps them: under the moved XDG_CACHE_HOME each
        # process would build them again (two builds, 40 s of the test's 57).
        env.setdefault("ETJAX_KERNEL_CACHE", str(kernel_cache_dir()))
        env["ETJAX_COMPILATION_CACHE"] = switch
        command = [sys.executable, "-c", script, str(tiny_hf_dir("llama"))]
        processes[switch] = subprocess.Popen(
            command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
    for switch, process in processes.items():
        _, stderr = process.communicate(timeout=600)
        assert process.returncode == 0, stderr[-3000:]
        cache = tmp_path / f"xdg{switch}" / "etjax" / "xla"
        if switch == "off":
            assert not cache.exists()
        else:
            assert any(cache.iterdir())  # the step programs, kept for the next process
