"""The ragged step lowers for the accelerators, from this CPU: `jax.export` of `mixed_step` for
a TPU and a CUDA GPU, dense and pruned, at SmolLM2's and Gemma 3 270M's real shapes, with the
kernels each platform's engine resolves (tests/step_export.py).

Lowering runs every platform rule JAX has for the program: the Pallas kernels must lower to
Mosaic (TPU) or Triton (CUDA), not to their interpreted form, and a construct a platform cannot
take fails here. Nothing runs; the exported programs are checked for the kernels' custom calls.
"""

from __future__ import annotations

import numpy as np
import pytest
from jax import export

from etjax.loaders.gguf_weights import gguf_model_config, open_gguf
from etjax.pruning.config import PruningConfig
from etjax.runtime.options import RuntimeOptions
from tests.step_export import TRITON_CALL, export_ragged_step

# The custom call each platform's Pallas kernels lower to.
KERNEL_CALL = {"tpu": "tpu_custom_call", "cuda": TRITON_CALL}


def _options(pruning: bool) -> RuntimeOptions:
    chosen = PruningConfig(enabled=True) if pruning else PruningConfig()
    return RuntimeOptions(pruning=chosen, max_batch_size=4, max_prefill_rows=2)


@pytest.mark.parametrize("pruning", [False, True], ids=["dense", "pruned"])
@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_smollm2_ragged_step_lowers_for_the_accelerator(smollm2_path, platform, pruning):
    cfg = gguf_model_config(open_gguf(smollm2_path), "float32")
    _check(export_ragged_step(cfg, _options(pruning), platform), cfg, platform, pruning)


@pytest.mark.parametrize("pruning", [False, True], ids=["dense", "pruned"])
@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_gemma3_ragged_step_lowers_for_the_accelerator(gemma3_270m_path, platform, pruning):
    cfg = gguf_model_config(open_gguf(gemma3_270m_path), "float32")
    _check(export_ragged_step(cfg, _options(pruning), platform), cfg, platform, pruning)


def _check(exported: export.Exported, cfg, platform: str, pruning: bool) -> None:
    assert exported.platforms == (platform,)
    text = exported.mlir_module()
    # Every step runs a Pallas kernel, lowered for the device, not interpreted (a TPU's dense
    # steps its ragged pass, pallas_kernels/ragged_attention/pallas_tpu.py).
    assert KERNEL_CALL[platform] in text
    # The StableHLO a deployment would ship, at the model's shapes: the last output is the
    # prefill chunks' float32 logits over the whole vocabulary, then the prompt tokens'
    # float32 log-probabilities, one per flat token.
    assert exported.mlir_module_serialized
    logits, prompt_logprobs = exported.out_avals[-2:]
    assert logits.dtype == np.float32 and logits.shape[-1] == cfg.vocab_size
    assert prompt_logprobs.dtype == np.float32 and prompt_logprobs.ndim == 1
