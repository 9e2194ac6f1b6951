"""Entropy-steered experts (etjax/experts): a decode token drawn from a low-entropy
distribution runs k' < k routed experts, renormalised over the kept ones.

The layer is checked against a float64 NumPy mixture of the top-k' experts; the grouping
against a count by hand; the engine against transformers. For the engine, the tiny Qwen3-MoE
has a dense first layer and a sparse last one, so no cached key or value depends on how many
experts a token ran: each position's logits are then transformers' with k = 2 or with k = 1
(the same weights), whichever the entropy of the distribution its token was drawn from picks.
With the setting off, the programs are the ones they were (`StepStatics.experts` is None), and
tests/test_moe.py checks their greedy tokens against transformers.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
import torch

import etjax
from etjax.entropy.cost import CostModel
from etjax.errors import ConfigError, FieldError
from etjax.experts import ExpertConfig
from etjax.model.experts import expert_groups, routed_experts
from etjax.run_config import load_run_config
from tests.conftest import TINY_VOCAB
from tests.test_moe import tiny_qwen3_moe_config
from tests.test_qwen3 import save_tiny_model

NEW_TOKENS = 16


def steered_reference(x, router, w_gate_up, w_down, top_k, normalize, active_k):
    """float64: token t runs its active_k[t] highest-ranked experts, weighted by their softmax
    probabilities scaled to the mass its top_k carry (1 when `normalize`)."""
    x, router, w_gate_up, w_down = (
        np.asarray(a, np.float64) for a in (x, router, w_gate_up, w_down)
    )
    logits = x @ router.T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        ranked = np.argsort(-probs[t])
        kept = ranked[: active_k[t]]
        target = 1.0 if normalize else probs[t, ranked[:top_k]].sum()
        for e in kept:
            gate, up = np.split(w_gate_up[e] @ x[t], 2)
            expert = w_down[e] @ (gate / (1 + np.exp(-gate)) * up)
            out[t] += probs[t, e] / probs[t, kept].sum() * target * expert
    return out


def _layer(seed=4, t=13, d=16, m=8, e=8):
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((t, d)).astype(np.float32),
        rng.standard_normal((e, d)).astype(np.float32),
        rng.standard_normal((e, 2 * m, d)).astype(np.float32) * 0.3,
        rng.standard_normal((e, d, m)).astype(np.float32) * 0.3,
    )


@pytest.mark.parametrize("normalize", [True, False], ids=["renormalised", "raw"])
def test_steered_experts_equal_a_top_k_prime_mixture(normalize):
    # Every token at k' = 1 (of 2), every token at k' = 2 (of 3), and a mix of 1, 2 and 3 in
    # one batch: each token as if it ran alone with its own k'.
    x, router, w_gate_up, w_down = _layer()
    t = x.shape[0]
    steered = jax.jit(routed_experts, static_argnums=(4, 5))
    mixed = np.random.default_rng(5).integers(1, 4, size=t).astype(np.int32)
    for top_k, active_k in ((2, np.ones(t, np.int32)), (3, np.full(t, 2, np.int32)), (3, mixed)):
        ours = steered(x, router, w_gate_up, w_down, top_k, normalize, active_k)
        want = steered_reference(x, router, w_gate_up, w_down, top_k, normalize, active_k)
        np.testing.assert_allclose(np.asarray(ours), want, rtol=1e-5, atol=1e-5)


def test_all_k_active_is_the_unsteered_layer():
    x, router, w_gate_up, w_down = _layer(seed=6)
    layer = jax.jit(routed_experts, static_argnums=(4, 5))
    full = layer(x, router, w_gate_up, w_down, 2, True)
    steered = layer(x, router, w_gate_up, w_down, 2, True, np.full(13, 2, np.int32))
    np.testing.assert_allclose(np.asarray(steered), np.asarray(full), rtol=1e-6, atol=1e-7)


def test_dropped_pairs_join_no_expert_group():
    # The grouped products get sum(k') rows in groups, not T*k: each expert's group size is
    # the number of tokens that keep it, counted by hand.
    experts = np.array([[3, 1], [1, 0], [3, 2], [0, 3]], np.int32)
    active_k = np.array([1, 2, 1, 2], np.int32)
    order, token, sizes = (np.asarray(a) for a in expert_groups(experts, 4, active_k))
    assert sizes.tolist() == [2, 1, 0, 3]  # kept pairs: 3 | 1, 0 | 3 | 0, 3
    assert sizes.sum() == active_k.sum() == 6
    grouped = token[: sizes.sum()]
    assert sorted(grouped.tolist()) == [0, 1, 1, 2, 3, 3]
    assert (token[sizes.sum() :] == 4).all()  # the two dropped pairs: no token
    # Each grouped row's pair is a kept pair of its token, in expert order.
    rows_experts = experts.reshape(-1)[order[: sizes.sum()]]
    assert rows_experts.tolist() == sorted(rows_experts.tolist())


def test_cost_counts_the_experts_a_token_ran():
    # A token that runs one expert of two saves one expert's three projections in every
    # sparse layer (one here, D = 64, M = 32): 2 * 3 D M FLOPs and 3 D M weights of 4 bytes.
    from etjax.loaders.hf_config import hf_config_to_model_config

    raw = tiny_qwen3_moe_config().to_dict()
    cfg = hf_config_to_model_config(raw, "float32", source="config.json")
    cost = CostModel.for_model(cfg, page_size=4)
    keys, active = jax.numpy.asarray([8.0, 8.0]), jax.numpy.asarray([True, True])
    flops, nbytes = cost.token_cost(keys, active, active_k=jax.numpy.asarray([1, 2]))
    full_flops, full_bytes = cost.token_cost(keys, active)
    assert float(full_flops[0] - flops[0]) == 2 * 3 * 64 * 32
    assert float(full_bytes[0] - nbytes[0]) == 3 * 64 * 32 * 4 / 2  # shared by the two rows
    assert float(flops[1]) == float(full_flops[1])


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"enabled": 1}, "experts.enabled"),
        ({"entropy_threshold": -0.5}, "experts.entropy_threshold"),
        ({"entropy_threshold": float("inf")}, "experts.entropy_threshold"),
        ({"reduced_top_k": 0}, "experts.reduced_top_k"),
    ],
)
def test_bad_settings_are_refused_by_name(fields, named):
    with pytest.raises(FieldError, match=named):
        ExpertConfig(**fields)


def test_experts_table_of_a_run_config(tmp_path):
    path = tmp_path / "steered.toml"
    path.write_text("[experts]\nenabled = true\nentropy_threshold = 2\nreduced_top_k = 1\n")
    options = load_run_config(path).options
    assert options.experts == ExpertConfig(enabled=True, entropy_threshold=2.0, reduced_top_k=1)
    path.write_text("[experts]\nreduced_top_k = 0\n")
    with pytest.raises(ConfigError, match=r"\[experts\].*reduced_top_k=0"):
        load_run_config(path)
    assert load_run_config("baseline").options.experts == ExpertConfig()  # off by default


@pytest.fixture(scope="module")
def last_layer_moe(tmp_path_factory, hf_smollm2_tokenizer):
    """The tiny Qwen3-MoE with layer 0 dense and layer 1 sparse (top 2 of 8, renormalised):
    (etjax's model, transformers' at k = 2, transformers' at k = 1, same weights)."""
    from transformers import AutoModelForCausalLM

    directory = tmp_path_factory.mktemp("tiny-steered-moe")
    config = tiny_qwen3_moe_config(mlp_only_layers=[0], norm_topk_prob=True)
    save_tiny_model(config, directory, hf_smollm2_tokenizer, seed=17)
    hf = {
        k: AutoModelForCausalLM.from_pretrained(
            directory, dtype=torch.float32, num_experts_per_tok=k
        ).eval()
        for k in (1, 2)
    }
    return etjax.load_model(directory, dtype="float32"), hf[2], hf[1]


def _entropy(logits):
    logp = torch.log_softmax(torch.as_tensor(logits, dtype=torch.float64), -1)
    return -(logp.exp() * logp).sum(-1).numpy()


def test_decode_steers_each_token_as_transformers_would(last_layer_moe):
    # Greedy decode() of three prompts in one batch, threshold at the median entropy of the
    # prompts' own positions, so that rows and steps mix k' = 1 and k = 2. Truth, per
    # generated token: the argmax of transformers' logits with k = 1 at the position before
    # it where the token before it was drawn from a distribution of entropy below the
    # threshold (with k = 2 otherwise, and for the first token, drawn from the prefill).
    model, hf_k2, hf_k1 = last_layer_moe
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, TINY_VOCAB, size=n).tolist() for n in (6, 17, 29)]
    with torch.no_grad():
        prompt_entropy = np.concatenate(
            [_entropy(hf_k2(torch.tensor([p])).logits[0].numpy()) for p in prompts]
        )
    threshold = float(np.median(prompt_entropy))
    experts = ExpertConfig(enabled=True, entropy_threshold=threshold, reduced_top_k=1)
    results = etjax.decode(
        [model.tokenizer.decode(p) for p in prompts],
        model=model,
        max_new_tokens=NEW_TOKENS,
        ignore_eos=True,
        page_size=4,
        experts=experts,
    )
    steered_tokens = 0
    for result in results:
        sequence = torch.tensor([result.prompt_token_ids + result.token_ids])
        with torch.no_grad():
            logits = {1: hf_k1(sequence).logits[0].numpy(), 2: hf_k2(sequence).logits[0].numpy()}
        start = len(result.prompt_token_ids) - 1  # the position that predicts token 0
        drawn_from = 0.0  # the entropy of the distribution the current token was drawn from
        for i, token in enumerate(result.token_ids):
            k = 2  # token 0: drawn from the prefill's logits
            if i:
                k = 1 if drawn_from < threshold else 2
                steered_tokens += k == 1
            expected = logits[k][start + i]
            # A token whose choice of k sits within rounding of the threshold is not checked.
            ambiguous = i > 0 and abs(drawn_from - threshold) < 1e-4
            assert token == int(np.argmax(expected)) or ambiguous
            drawn_from = float(_entropy(expected))
            assert result.entropy[i] == pytest.approx(drawn_from, abs=1e-3)
    # Both kinds of step happened, in the batch of three.
    assert 0 < steered_tokens < 3 * (NEW_TOKENS - 1)


def test_a_model_that_cannot_be_steered_is_refused(last_layer_moe):
    model = last_layer_moe[0]
    with pytest.raises(FieldError, match=r"experts\.reduced_top_k=2; must be less than"):
        etjax.decode("a", model=model, max_new_tokens=2, experts=ExpertConfig(True, 1.0, 2))
    dense = dataclasses.replace(model.config, num_experts=0, num_experts_per_tok=0)
    with pytest.raises(FieldError, match=r"experts\.enabled=True; must be false for a model"):
        ExpertConfig(enabled=True).check_model(dense)
