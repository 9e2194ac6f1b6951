"""Sharded decoding on a (data, model) mesh of 8 forced CPU devices equals single-device
decoding; vocabulary-sharded logits reach the entropy estimators without being gathered."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

import numpy as np
import pytest

from etjax.distributed.mesh import MeshShape
from etjax.errors import ConfigError
from tests.subprocess_env import ROOT, subprocess_env


@dataclasses.dataclass
class _Worker:
    """A worker process whose JAX sees 8 CPU devices; it prints its JSON result last. Its output
    goes to files: a pipe that fills would block it while another worker is waited for."""

    proc: subprocess.Popen
    stdout: IO[str]
    stderr: IO[str]

    def result(self, timeout: int = 900) -> dict:
        returncode = self.proc.wait(timeout=timeout)
        self.stderr.seek(0)
        assert returncode == 0, self.stderr.read()[-3000:]
        self.stdout.seek(0)
        return json.loads(self.stdout.read().strip().splitlines()[-1])


def _start_worker(stack: contextlib.ExitStack, module: str, *args: str) -> _Worker:
    # `stack` closes its files, and kills it if it still runs (a test failed before waiting).
    stdout, stderr = (
        stack.enter_context(tempfile.TemporaryFile("w+"))  # noqa: SIM115 - the stack closes it
        for _ in range(2)
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        env=subprocess_env(forced_devices=8),
        cwd=ROOT,
        stdout=stdout,
        stderr=stderr,
        text=True,
    )
    stack.callback(proc.kill)  # a no-op once it has ended
    return _Worker(proc, stdout, stderr)


def _run_worker(module: str, *args: str) -> dict:
    with contextlib.ExitStack() as stack:
        return _start_worker(stack, module, *args).result()


class _Workers:
    """Named worker commands run one per core at a time (two at least), in the order given:
    each compiles its programs on one thread (XLA:CPU compiles a program so) while this
    process waits, so on 2 cores two take about as long as one, and no more than that many
    hold memory at once. A worker starts as soon as a slot is free, checked whenever a result
    is awaited."""

    def __init__(self, stack: contextlib.ExitStack, commands: dict):
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2
        self._stack, self._slots = stack, max(2, cores)
        self._pending = dict(commands)
        self._running: dict[str, _Worker] = {}
        self._ended: dict[str, _Worker] = {}
        self._fill()

    def result(self, name: str, timeout: int = 900) -> dict:
        deadline = time.monotonic() + timeout
        while name not in self._ended:
            assert time.monotonic() < deadline, f"the {name} worker ran past {timeout} s"
            time.sleep(0.05)
            for ended in [n for n, w in self._running.items() if w.proc.poll() is not None]:
                self._ended[ended] = self._running.pop(ended)
            self._fill()
        return self._ended[name].result()

    def _fill(self) -> None:
        while self._pending and len(self._running) < self._slots:
            name, command = next(iter(self._pending.items()))
            del self._pending[name]
            self._running[name] = _start_worker(self._stack, *command)


def _moe_command(family: str, tmp_path_factory, tokenizer) -> tuple[str, ...]:
    from tests.test_moe import save_tiny_moe

    directory = save_tiny_moe(family, tmp_path_factory, tokenizer)
    return ("tests.mesh_worker", str(directory), "--meshes", "1x1,2x4", "--temperatures", "0.0,0.8")


@pytest.fixture(scope="module")
def workers(tiny_hf_dir, family_dirs, tmp_path_factory, hf_smollm2_tokenizer) -> _Workers:
    """The module's workers, from its first test that needs one (`_Workers`). The tiny
    Llama's meshes are split in two workers of about equal compile time (the 2x4 mesh with
    pruning on, the costliest, compiles as long again as its dense run), so no program
    compiles twice; those two run first, then the others in the order the tests read them."""
    tiny = ("tests.mesh_worker", str(tiny_hf_dir("llama")), "--temperatures", "0.0,0.8")
    commands = {
        "tiny": (*tiny, "--meshes", "1x1,1x8,8x1", "--pruned-meshes", "1x1"),
        "tiny-2x4": (*tiny, "--meshes", "2x4", "--pruned-meshes", "2x4"),
        "qwen3_moe": _moe_command("qwen3_moe", tmp_path_factory, hf_smollm2_tokenizer),
        "families": ("tests.family_mesh_worker", "2x4", *map(str, family_dirs.values())),
        "vocabulary": ("tests.vocab_shard_worker",),
        "restore": (
            "tests.restore_worker",
            str(tiny_hf_dir("llama")),
            str(tmp_path_factory.mktemp("checkpoint") / "ckpt"),
        ),
    }
    with contextlib.ExitStack() as stack:
        yield _Workers(stack, commands)


def test_mesh_shape_parsing_and_errors():
    assert MeshShape.parse("2x4") == MeshShape(2, 4)
    assert str(MeshShape.parse("8X1")) == "8x1"
    for bad in ("2", "2x", "axb", "0x8", "2x4x1"):
        with pytest.raises(ConfigError, match="mesh"):
            MeshShape.parse(bad)


@pytest.fixture(scope="module")
def tiny_on_meshes(workers) -> dict:
    first, second = workers.result("tiny"), workers.result("tiny-2x4")
    return {
        "devices": min(first["devices"], second["devices"]),
        "outputs": {t: first["outputs"][t] | second["outputs"][t] for t in ("0.0", "0.8")},
        "pruned": first["pruned"] | second["pruned"],
    }


def test_tiny_model_outputs_equal_on_every_mesh(tiny_on_meshes):
    # Greedy and seeded sampling: the sampler draws with the same key per row and token
    # whatever the sharding (threefry is partitionable), so tokens must match exactly.
    result = tiny_on_meshes
    assert result["devices"] == 8
    for temperature in ("0.0", "0.8"):
        outputs = result["outputs"][temperature]
        for mesh in ("1x8", "2x4", "8x1"):
            assert outputs[mesh] == outputs["1x1"], (temperature, mesh)
    assert result["outputs"]["0.8"]["1x1"] != result["outputs"]["0.0"]["1x1"]  # it sampled


def test_tiny_model_pruned_outputs_equal_on_every_mesh(tiny_on_meshes):
    outputs = tiny_on_meshes["pruned"]
    assert outputs["2x4"] == outputs["1x1"]


# Mixtral's check takes as long again as Qwen3-MoE's (its own four step programs to compile,
# about 10 s of CPU), so it runs with the slow tests.
@pytest.mark.parametrize("family", ["qwen3_moe", pytest.param("mixtral", marks=pytest.mark.slow)])
def test_tiny_moe_outputs_equal_on_every_mesh(
    family, workers, tmp_path_factory, hf_smollm2_tokenizer
):
    # Expert parallelism: on a 2x4 mesh each device holds 2 of the 8 experts and runs the
    # rows routed to them. Greedy and seeded tokens, and the top-3 ids, equal one device's.
    if family == "qwen3_moe":
        result = workers.result(family)
    else:
        result = _run_worker(*_moe_command(family, tmp_path_factory, hf_smollm2_tokenizer))
    outputs = result["outputs"]
    for temperature in ("0.0", "0.8"):
        assert outputs[temperature]["2x4"] == outputs[temperature]["1x1"], temperature
    assert outputs["0.8"]["1x1"] != outputs["0.0"]["1x1"]  # it sampled
    # Where the engine placed them: the stacked experts, gate|up [E=8, 2M=64, D=64] and down
    # [8, D=64, M=32], split by expert over the model axis of 4, each expert whole on its
    # device; the router [8, 64] replicated.
    layout = result["experts"]["2x4"]
    assert layout["experts_gate_up"] == {"shards": [[8 // 4, 64, 64]], "devices": 8}
    assert layout["experts_down"] == {"shards": [[8 // 4, 64, 32]], "devices": 8}
    assert layout["router"] == {"shards": [[8, 64]], "devices": 8}
    assert result["experts"]["1x1"]["experts_gate_up"]["shards"] == [[8, 64, 64]]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory, hf_smollm2_tokenizer) -> dict[str, Path]:
    """Qwen3, Phi-3 and Gemma 2, each its tiny model of test_qwen3/_phi3/_gemma2 cut to 2
    layers, 8 query heads over 4 KV heads (so the KV pages split by head), saved."""
    from tests.test_gemma2 import tiny_gemma2_config
    from tests.test_phi3 import tiny_phi3_config
    from tests.test_qwen3 import save_tiny_model, tiny_qwen3_config

    heads = dict(num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4)
    configs = {
        # Its second layer windowed (`max_window_layers`), the first global.
        "qwen3": tiny_qwen3_config(**heads, head_dim=8, max_window_layers=1),
        "phi3": tiny_phi3_config(**heads),  # windowed every layer
        "gemma2": tiny_gemma2_config(**heads, head_dim=8),  # windowed, then global
    }
    return {
        name: save_tiny_model(
            config, tmp_path_factory.mktemp(f"mesh-{name}"), hf_smollm2_tokenizer, seed=11
        )
        for name, config in configs.items()
    }


def test_dense_families_on_a_mesh_match_transformers(workers, family_dirs):
    # Qwen3, Phi-3 and Gemma 2 (`family_dirs`) on a 2x4 mesh: both rows' logits through the
    # paged cache (a prefill chunk, then a decode token beside a second chunk) within the
    # families' tolerance of transformers', greedy tokens the same.
    # One worker for the three and one program each (tests/family_mesh_worker.py says why
    # not the engine); the engine's own path on meshes is the tiny Llama's and Qwen3-MoE's.
    import torch
    from transformers import AutoModelForCausalLM

    from tests.conftest import relative_error
    from tests.test_phi3 import TOLERANCE

    result = workers.result("families")
    assert result["devices"] == 8
    for name, directory in family_dirs.items():
        saved = np.load(directory / "mesh-2x4.npz")
        reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        for ids, logits in zip(saved["ids"], saved["logits"], strict=True):
            ids = ids[ids >= 0]
            with torch.no_grad():
                truth = reference(torch.tensor(ids[None])).logits[0].numpy()
            ours = logits[: len(ids)]
            assert relative_error(ours, truth) < TOLERANCE, name
            assert np.array_equal(ours.argmax(-1), truth.argmax(-1)), name
        # Split over the model axis of 4: q|k|v [8*8 + 2*4*8 = 128, 64] by output unit, the
        # embedding by vocabulary, the KV pages [layers, pages, 4, 16, 8] by KV head.
        layout = result["layouts"][str(directory)]
        assert layout == {
            "wqkv": [128 // 4, 64],
            "embed": [49152 // 4, 64],
            "k_pages": [2, 7, 1, 16, 8],
        }


@pytest.mark.slow
def test_smollm2_greedy_outputs_equal_on_every_mesh():
    outputs = _run_worker(
        "tests.mesh_worker",
        "smollm2",
        "--meshes",
        "1x1,1x8,2x4,8x1",
        "--new",
        "8",
    )["outputs"]["0.0"]
    for mesh in ("1x8", "2x4", "8x1"):
        assert outputs[mesh] == outputs["1x1"], mesh


def test_vocabulary_sharded_entropy_is_never_gathered(workers):
    result = workers.result("vocabulary")
    # The exact entropy, the top-k tail bounds, top-k itself and the sampler (temperature,
    # entropic controller, top-p / min-p) on [4, V] logits split 8 ways over the vocabulary:
    # no collective moves a full vocabulary row, and tokens and values equal the one-device
    # ones.
    assert result["largest_collective_elements"] < result["vocab_size"]
    assert result["max_abs_error"] < 1e-5


def test_checkpoint_restores_straight_into_the_sharded_layout(workers):
    # The tiny Llama converted by `etjax convert`, restored onto a 2x4 mesh.
    weights = workers.result("restore")["weights"]
    # Tiny llama: vocab 49152, hidden 64, q|k|v 128 rows, MLP 128; model axis of 4.
    assert weights["embed"]["shards"] == [[49152 // 4, 64]]
    assert weights["wqkv"]["shards"] == [[128 // 4, 64]]
    assert weights["w_down"]["shards"] == [[64, 128 // 4]]
    assert weights["attn_norm"]["shards"] == [[64]]  # replicated
    for name, w in weights.items():
        assert w["devices"] == 8 and w["equal"], name
