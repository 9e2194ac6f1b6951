"""A wheel installed in a fresh virtual environment works outside the source tree: the
shipped configs and model presets are package data, found through importlib.resources, not
beside a checkout."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests import compile_level
from tests.subprocess_env import ROOT, subprocess_env

BUILD = (
    "from setuptools import build_meta; print(build_meta.build_wheel(__import__('sys').argv[1]))"
)


@pytest.mark.compile_bound  # SmolLM2 in bfloat16, one token: compiles more than it runs
def test_a_wheel_runs_batch_with_the_shipped_config_and_preset(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("etjax", "pallas_kernels", "cpp_kernels"):
        shutil.copytree(ROOT / name, source / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    wheels = tmp_path / "wheels"
    built = subprocess.run(
        [sys.executable, "-c", BUILD, str(wheels)],
        cwd=source,
        capture_output=True,
        text=True,
        check=True,
    )
    wheel = wheels / built.stdout.split()[-1]
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    # configs/ at the top of the clone ships inside the package (etjax/configs links to it).
    assert "etjax/configs/default.toml" in names
    assert "etjax/configs/models/smollm2-135m-bf16.toml" in names
    # The C++ kernels' sources, which the wheel's first run compiles.
    sources = [p.name for p in (ROOT / "cpp_kernels").iterdir() if p.suffix in (".cc", ".h")]
    assert sources and all(f"cpp_kernels/{name}" in names for name in sources)

    # A fresh virtual environment with the wheel installed by pip (console script included).
    # Its dependencies come from this environment's site-packages as a plain path entry: the
    # checkout's editable install there is not processed, so only the wheel provides etjax.
    fresh = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(fresh)], check=True)
    python = fresh / "bin" / "python"
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q"]
    subprocess.run([*install, "--no-deps", str(wheel)], check=True, capture_output=True)
    site = subprocess.run(
        [str(python), "-c", "import site; print(site.getsitepackages()[0])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(site) / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = subprocess_env()
    env.pop("PYTHONPATH")  # not the checkout
    if env.get(compile_level.ENV) == "1":  # nor tests/child_site, which imports it: by XLA_FLAGS
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {compile_level.LOOP_EMITTERS}"
    work = tmp_path / "elsewhere"
    work.mkdir()
    # Where `import etjax` finds it, without importing it (and JAX with it) for that.
    where = subprocess.run(
        [str(python), "-c", "import importlib.util as u; print(u.find_spec('etjax').origin)"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert where.stdout.strip().startswith(site)
    etjax_command = str(fresh / "bin" / "etjax")
    # Beside the job (it imports JAX too: 2.5 s of CPU on a core the job leaves idle).
    version = subprocess.Popen(
        [etjax_command, "--version"], cwd=work, env=env, stdout=subprocess.PIPE, text=True
    )
    # One token: the prefill's programs alone, no decode burst's to compile too.
    (work / "in.jsonl").write_text(json.dumps({"prompt": "Hello", "max_new_tokens": 1}) + "\n")
    command = [etjax_command, "batch", "--input", "in.jsonl"]
    command += ["--output", "out.jsonl", "--config", "default", "--no-progress"]
    job = subprocess.run(
        [*command, "--model", "smollm2-135m-bf16"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
    )
    assert job.returncode == 0, job.stderr
    assert version.communicate(timeout=120)[0].strip() == "etjax 0.1.0"
    (result,) = [json.loads(line) for line in (work / "out.jsonl").read_text().splitlines()]
    assert result["error"] is None and len(result["token_ids"]) == 1
