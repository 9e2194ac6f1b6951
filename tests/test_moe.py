"""Mixture-of-experts families (Qwen3-MoE, Mixtral) against transformers, and the grouped
expert products against a dense all-experts reference.

The tiny models: 2 layers, grouped-query attention, 8 experts of which each token runs 2,
random norm scales. Qwen3-MoE's second layer is dense (`mlp_only_layers`) and its top-2
weights are not renormalised (`norm_topk_prob` false); Mixtral renormalises them and has a
sliding window of 8 positions on every layer. Their GGUF files are of the same shapes as
llama.cpp's converter can write them: every layer routed, the top 2 renormalised, no window.
Tolerance as in test_model_parity.py.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch

import etjax
from etjax.entropy.cost import CostModel
from etjax.errors import ModelLoadError
from etjax.loaders.hf_config import hf_config_to_model_config
from etjax.model.experts import routed_experts
from tests.conftest import TINY_VOCAB, relative_error
from tests.model_runner import full_logits
from tests.test_qwen3 import save_tiny_model

TOLERANCE = 1e-4
WINDOW = 8
NEW_TOKENS = 32
SHAPES = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    num_experts_per_tok=2,
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_qwen3_moe_config(**overrides):
    """transformers' own Qwen3-MoE config of the tiny test model."""
    from transformers import Qwen3MoeConfig

    fields = dict(
        SHAPES,
        intermediate_size=96,  # the dense layer's
        moe_intermediate_size=32,
        num_experts=8,
        norm_topk_prob=False,
        mlp_only_layers=[1],
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=False,
    )
    return Qwen3MoeConfig(**{**fields, **overrides})


def tiny_mixtral_config(**overrides):
    """transformers' own Mixtral config of the tiny test model."""
    from transformers import MixtralConfig

    fields = dict(SHAPES, intermediate_size=32, num_local_experts=8, sliding_window=WINDOW)
    return MixtralConfig(**{**fields, **overrides})


CONFIGS = {"qwen3_moe": tiny_qwen3_moe_config, "mixtral": tiny_mixtral_config}


def save_tiny_moe(family: str, tmp_path_factory, tokenizer):
    """The tiny random model of `family` (a key of CONFIGS), saved to a new directory."""
    directory = tmp_path_factory.mktemp(f"tiny-{family}")
    return save_tiny_model(CONFIGS[family](), directory, tokenizer, seed=13)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny_moe(request, tmp_path_factory, hf_smollm2_tokenizer):
    """(etjax's model, transformers' model) of one tiny family, written once per module."""
    from transformers import AutoModelForCausalLM

    directory = save_tiny_moe(request.param, tmp_path_factory, hf_smollm2_tokenizer)
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return etjax.load_model(directory, dtype="float32"), reference


def test_tiny_moe_logits_match_transformers(tiny_moe):
    model, reference_model = tiny_moe
    cfg = model.config
    assert (cfg.num_experts, cfg.num_experts_per_tok) == (8, 2)
    if cfg.architecture == "qwen3_moe":
        assert cfg.dense_mlp_layers == (1,) and not cfg.norm_topk_prob
        assert model.weights.layers[1].router is None
    else:
        assert cfg.local_layers == (0, 1) and cfg.sliding_window == WINDOW
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(2, 48), dtype=np.int32)
    with torch.no_grad():
        reference = reference_model(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    ours = full_logits(model.weights, cfg, ids, page_size=4)
    assert relative_error(ours, reference) < TOLERANCE
    # (The other weighting of the top 2 moved these logits by more than 1e-2 of the largest,
    # measured once; a second configuration here would cost a compile.)


def test_tiny_moe_greedy_decode_matches_transformers(tiny_moe):
    # Through `decode()` (ragged prefill, cached decode steps in bursts), three prompts of
    # different lengths together, 32 new tokens each. Greedy equality with transformers is
    # checked as what it means: every token etjax generates is transformers' argmax given the
    # tokens before it, read from one forward pass over each whole sequence (transformers'
    # `generate` took 10 s here for what one pass shows).
    model, reference_model = tiny_moe
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, TINY_VOCAB, size=n).tolist() for n in (5, 21, 40)]
    texts = [model.tokenizer.decode(p) for p in prompts]
    results = etjax.decode(
        texts, model=model, max_new_tokens=NEW_TOKENS, ignore_eos=True, page_size=4
    )
    sequences = [r.prompt_token_ids + r.token_ids for r in results]
    assert [len(r.token_ids) for r in results] == [NEW_TOKENS] * 3
    width = max(map(len, sequences))
    # Right-padded: causal attention keeps the padding out of every real position.
    batch = torch.tensor([s + [0] * (width - len(s)) for s in sequences])
    with torch.no_grad():
        chosen = reference_model(batch).logits.argmax(-1).numpy()
    for result, row in zip(results, chosen, strict=True):
        start = len(result.prompt_token_ids) - 1
        assert result.token_ids == row[start : start + NEW_TOKENS].tolist()


def routed_experts_reference(x, router, w_gate_up, w_down, top_k, normalize):
    """Every expert run on every token (numpy, float64), kept where the token routes to it."""
    x, router, w_gate_up, w_down = (
        np.asarray(a, np.float64) for a in (x, router, w_gate_up, w_down)
    )
    logits = x @ router.T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    chosen = np.argsort(-probs, axis=-1)[:, :top_k]
    weights = np.zeros_like(probs)
    np.put_along_axis(weights, chosen, np.take_along_axis(probs, chosen, -1), -1)
    if normalize:
        weights /= weights.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    for e in range(router.shape[0]):
        gate, up = np.split(x @ w_gate_up[e].T, 2, axis=-1)
        expert = (gate / (1 + np.exp(-gate)) * up) @ w_down[e].T
        out += weights[:, e : e + 1] * expert
    return out


@pytest.mark.parametrize("skew", [0.0, 8.0], ids=["spread", "one-expert"])
def test_grouped_experts_equal_all_experts_masked(skew):
    # 13 tokens, 8 experts, top 2 (and top 3 renormalised). "one-expert": a router that
    # sends every token to expert 5 first, so most experts get no rows at all.
    rng = np.random.default_rng(4)
    t, d, m, e = 13, 16, 8, 8
    x = rng.standard_normal((t, d)).astype(np.float32)
    router = rng.standard_normal((e, d)).astype(np.float32)
    router[5] += skew * x.mean(0) / np.square(x.mean(0)).sum()
    w_gate_up = rng.standard_normal((e, 2 * m, d)).astype(np.float32) * 0.3
    w_down = rng.standard_normal((e, d, m)).astype(np.float32) * 0.3
    grouped = jax.jit(routed_experts, static_argnums=(4, 5))
    for top_k, normalize in ((2, False), (3, True)):
        ours = np.asarray(grouped(x, router, w_gate_up, w_down, top_k, normalize))
        want = routed_experts_reference(x, router, w_gate_up, w_down, top_k, normalize)
        np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-5)


def test_cost_model_counts_the_experts_a_token_runs():
    # Hand count for the tiny Qwen3-MoE (layer 0 sparse, layer 1 dense): a sparse layer's
    # MLP runs its router (D E) and k = 2 of its E = 8 experts (3 D M each), and a token reads
    # those weights only; the parameters are transformers' own count.
    from transformers import AutoModelForCausalLM

    hf_config = tiny_qwen3_moe_config()
    cfg = hf_config_to_model_config(hf_config.to_dict(), "float32", source="config.json")
    d, v, hd, m = 64, TINY_VOCAB, 16, 32
    attention = d * (4 + 2 + 2) * hd + 4 * hd * d
    sparse, dense = attention + d * 8 + 2 * 3 * d * m, attention + 3 * d * 96
    cost = CostModel.for_model(cfg, page_size=4)
    assert cost.matmul_flops_per_token == 2.0 * (sparse + dense + d * v)
    with torch.device("meta"):
        parameters = AutoModelForCausalLM.from_config(hf_config).num_parameters()
    assert cost.weight_bytes == 4.0 * (parameters - 6 * 3 * d * m)
    # Held as int8 (weights="int8"): an expert's three matrices at a byte a weight and a
    # float32 scale an output row (gate|up 2M rows of D, down D rows of M), and a token leaves
    # 6 of the 8 unread in those bytes, not in float32's.
    from etjax.model.quantized import weights_bytes
    from etjax.model.weights import abstract_weights, routed_expert_bytes

    held = abstract_weights(cfg, "int8")
    expert = 3 * d * m + (2 * m + d) * 4
    assert routed_expert_bytes(held, cfg) == 8 * expert
    as_held = CostModel.for_model(
        cfg,
        page_size=4,
        resident_bytes=weights_bytes(held),
        expert_resident_bytes=routed_expert_bytes(held, cfg),
    )
    assert as_held.expert_bytes == expert
    assert as_held.weight_bytes == weights_bytes(held) - 6 * expert


@pytest.mark.parametrize(
    ("family", "change", "named"),
    [
        ("qwen3_moe", {"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size"),
        ("qwen3_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ("qwen3_moe", {"mlp_only_layers": [3]}, "mlp_only_layers"),
        ("qwen3_moe", {"attention_bias": True}, "attention_bias"),
        ("mixtral", {"n_shared_experts": 1}, "n_shared_experts"),
        ("mixtral", {"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_unsupported_moe_config_is_refused_by_name(family, change, named):
    raw = {**CONFIGS[family]().to_dict(), **change}
    with pytest.raises(ModelLoadError, match=named):
        hf_config_to_model_config(raw, "float32", source="config.json")


# What llama.cpp's converter can write: every layer routed, the top k renormalised (its
# graphs always renormalise), and for Mixtral (`llama`) no window (not in its metadata).
GGUF_CONFIGS = {
    "qwen3moe": lambda: tiny_qwen3_moe_config(norm_topk_prob=True, mlp_only_layers=[]),
    "llama": lambda: tiny_mixtral_config(sliding_window=None),
}


@pytest.fixture(scope="module", params=sorted(GGUF_CONFIGS))
def tiny_moe_gguf(request, tmp_path_factory, hf_smollm2_tokenizer):
    """(GGUF architecture, etjax's model read from the Hugging Face directory, transformers'
    model, the model written as llama.cpp lays out that architecture, F32)."""
    from transformers import AutoModelForCausalLM

    from tests.gguf_builder import write_moe_gguf

    arch = request.param
    directory = tmp_path_factory.mktemp(f"tiny-gguf-{arch}")
    save_tiny_model(GGUF_CONFIGS[arch](), directory, hf_smollm2_tokenizer, seed=17)
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    path = directory / f"tiny-{arch}.gguf"
    write_moe_gguf(reference, path, arch)
    return arch, etjax.load_model(directory, dtype="float32"), reference, path


def _read_gguf(path):
    from etjax.loaders.gguf_weights import (
        gguf_model_config,
        gguf_tensors,
        load_gguf_weights,
        open_gguf,
    )

    reader = open_gguf(path)
    cfg = gguf_model_config(reader, "float32")
    return cfg, load_gguf_weights(gguf_tensors(reader), cfg)


def test_tiny_moe_gguf_loads_the_same_model(tiny_moe_gguf):
    # etjax reads the file to the config and the weights, bit for bit, it reads from the
    # Hugging Face directory, and its logits are transformers'. transformers reads the
    # qwen3moe file back to its own tensors (so the layout is llama.cpp's as transformers
    # knows it; it has no reader for Mixtral's, whose experts the converter stacks alike).
    import dataclasses

    from transformers import AutoModelForCausalLM

    arch, model, reference_model, path = tiny_moe_gguf
    if arch == "qwen3moe":
        reread = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, config=reference_model.config, dtype=torch.float32
        )
        expected = reference_model.state_dict()
        for name, tensor in reread.state_dict().items():
            torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0, msg=name)
    cfg, weights = _read_gguf(path)
    eps = float(np.float32(model.config.rms_norm_eps))  # GGUF metadata holds a float32
    assert cfg == dataclasses.replace(model.config, rms_norm_eps=eps)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.dense_mlp_layers) == (8, 2, ())
    jax.tree.map(np.testing.assert_array_equal, weights, model.weights)
    ids = np.random.default_rng(5).integers(0, cfg.vocab_size, size=(2, 48), dtype=np.int32)
    with torch.no_grad():
        reference = reference_model(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    assert relative_error(full_logits(weights, cfg, ids, page_size=4), reference) < TOLERANCE


def test_moe_gguf_experts_read_quantized_and_one_tensor_each(tiny_moe_gguf, tmp_path):
    # Q8_0 experts: each expert's slice of the stacked tensor is the `gguf` package's
    # dequantization of the whole tensor, cut at that expert. Mixtral as llama.cpp wrote it
    # before stacking its experts (one tensor per expert): the same weights as stacked.
    import gguf
    from gguf.quants import dequantize

    from tests.gguf_builder import write_moe_gguf

    arch, model, reference_model, _ = tiny_moe_gguf
    path = tmp_path / "q8.gguf"
    write_moe_gguf(reference_model, path, arch, gguf.GGMLQuantizationType.Q8_0)
    _, weights = _read_gguf(path)
    stored = {t.name: t for t in gguf.GGUFReader(path).tensors}

    def whole(name):
        t = stored[name]
        return dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))

    for i, layer in enumerate(weights.layers):
        gate_up = np.concatenate(
            [whole(f"blk.{i}.ffn_gate_exps.weight"), whole(f"blk.{i}.ffn_up_exps.weight")], 1
        )
        np.testing.assert_array_equal(layer.experts_gate_up, gate_up)
        np.testing.assert_array_equal(layer.experts_down, whole(f"blk.{i}.ffn_down_exps.weight"))
    if arch == "llama":
        split = tmp_path / "split.gguf"
        write_moe_gguf(reference_model, split, arch, split_experts=True)
        assert "blk.0.ffn_gate.7.weight" in {t.name for t in gguf.GGUFReader(split).tensors}
        jax.tree.map(np.testing.assert_array_equal, _read_gguf(split)[1], model.weights)


def _moe_header(path, arch, fields, tensors=("blk.0.ffn_gate_inp.weight",)):
    # A GGUF file with the metadata `gguf_model_config` reads before the experts', `fields`
    # ({arch}.key: value) and tiny stand-ins for the named tensors.
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(32)
    writer.add_head_count(4)
    writer.add_vocab_size(TINY_VOCAB)
    for key, value in fields.items():
        add = {bool: writer.add_bool, int: writer.add_uint32, float: writer.add_float32}
        add[type(value)](f"{arch}.{key}", value)
    for name in tensors:
        writer.add_tensor(name, np.zeros((2, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


EXPERTS = {"expert_count": 8, "expert_used_count": 2}


@pytest.mark.parametrize(
    ("arch", "fields", "tensors", "named"),
    [
        ("grok", EXPERTS, (), r"general\.architecture='grok'.*allowed: \('llama', "),
        ("qwen2", EXPERTS, (), r"qwen2\.expert_count=8 .*from: \('llama', 'qwen3moe'\)"),
        ("qwen3moe", {}, (), r"qwen3moe\.expert_count is missing"),
        ("qwen3moe", {**EXPERTS, "expert_used_count": 9}, None, "expert_used_count=9"),
        ("qwen3moe", {**EXPERTS, "expert_gating_func": 2}, None, "expert_gating_func=2"),
        ("llama", {**EXPERTS, "expert_weights_norm": False}, None, "expert_weights_norm"),
        ("llama", {**EXPERTS, "expert_shared_count": 1}, None, "expert_shared_count=1"),
        ("qwen3moe", {**EXPERTS, "leading_dense_block_count": 1}, None, "leading_dense"),
        ("qwen3moe", EXPERTS, ("blk.0.ffn_up_exps.weight",), r"layers \[0\] have no router"),
        (
            "llama",
            EXPERTS,
            ("blk.0.ffn_gate_inp.weight", "blk.0.ffn_up_shexp.weight"),
            "shared-expert tensors",
        ),
    ],
)
def test_moe_gguf_llama_cpp_cannot_mean_is_refused_by_name(arch, fields, tensors, named, tmp_path):
    # What a file says that llama.cpp's Mixtral and Qwen3-MoE do not compute (another
    # gating, unnormalised or scaled weights, shared experts, dense layers) is refused by the
    # key or tensor that says it; an architecture or expert count etjax does not read, with
    # what it reads.
    from etjax.loaders.gguf_weights import gguf_model_config, open_gguf

    path = tmp_path / "x.gguf"
    _moe_header(path, arch, fields, *(() if tensors is None else (tensors,)))
    with pytest.raises(ModelLoadError, match=named):
        gguf_model_config(open_gguf(path), "float32")


def test_moe_gguf_fused_gate_up_experts_are_refused_by_name(tiny_moe_gguf, tmp_path):
    # llama.cpp's converter can fuse each layer's gate and up experts into one tensor
    # (`--fuse-gate-up-exps`: ffn_gate_up_exps, [E, 2M, D]); etjax reads them apart.
    from etjax.loaders.gguf_weights import (
        gguf_model_config,
        gguf_tensors,
        load_gguf_weights,
        open_gguf,
    )
    from tests.gguf_builder import write_moe_gguf

    arch, _, reference_model, _ = tiny_moe_gguf
    if arch != "qwen3moe":
        pytest.skip("one architecture shows the refusal")
    path = tmp_path / "fused.gguf"
    write_moe_gguf(reference_model, path, arch, fuse_gate_up=True)
    reader = open_gguf(path)
    cfg = gguf_model_config(reader, "float32")
    with pytest.raises(ModelLoadError, match=r"'blk\.0\.ffn_gate_up_exps\.weight'.*allowed"):
        load_gguf_weights(gguf_tensors(reader), cfg)
