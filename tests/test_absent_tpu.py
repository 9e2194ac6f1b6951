"""JAX is told to use the CPU only where libtpu is installed on a host without a TPU chip or a
CUDA plugin, and never against a platform the user chose (etjax/absent_tpu.py)."""

from __future__ import annotations

import importlib.util

import pytest

from etjax import absent_tpu


@pytest.fixture
def libtpu_installed(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        absent_tpu.importlib.util,
        "find_spec",
        lambda name: (
            object() if name == "libtpu" else (None if name.startswith("jax_cuda") else real(name))
        ),
    )


def test_a_host_without_a_tpu_runs_on_the_cpu(libtpu_installed, monkeypatch):
    monkeypatch.setattr(absent_tpu, "has_tpu_chips", lambda: False)
    environ: dict[str, str] = {}
    absent_tpu.skip_absent_tpu(environ)
    assert environ == {"JAX_PLATFORMS": "cpu"}


def test_a_tpu_host_and_a_chosen_platform_are_left_alone(libtpu_installed, monkeypatch):
    monkeypatch.setattr(absent_tpu, "has_tpu_chips", lambda: True)
    environ: dict[str, str] = {}
    absent_tpu.skip_absent_tpu(environ)
    assert environ == {}
    monkeypatch.setattr(absent_tpu, "has_tpu_chips", lambda: False)
    chosen = {"JAX_PLATFORMS": "tpu"}
    absent_tpu.skip_absent_tpu(chosen)
    assert chosen == {"JAX_PLATFORMS": "tpu"}


def test_tpu_chips_are_google_pci_devices(tmp_path):
    for name, vendor in (("0000:00:04.0", "0x1af4\n"), ("0000:00:05.0", "0x8086\n")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "vendor").write_text(vendor)
    pattern = str(tmp_path / "*" / "vendor")
    assert not absent_tpu.has_tpu_chips(pattern)
    (tmp_path / "0000:00:06.0").mkdir()
    (tmp_path / "0000:00:06.0" / "vendor").write_text("0x1ae0\n")  # a TPU v5e chip's vendor
    assert absent_tpu.has_tpu_chips(pattern)
