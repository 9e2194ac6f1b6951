"""Entropic attention pruning inside the decode step."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import etjax
from etjax.attention import AttentionBackend, resolve_backend
from etjax.engine_build import RequestSettings, RuntimeOptions, generate_ids
from etjax.errors import RequestError
from etjax.pruning.config import PruningConfig
from tests.model_runner import full_logits

# A budget band far above any entropy this random model reaches (about 9.5 nats): every
# step keeps its minimum, 30% of the blocks and at least 3.
LOW_BUDGET = PruningConfig(
    enabled=True, min_fraction=0.3, entropy_low=50.0, entropy_high=60.0, min_blocks=3
)


def _entropy(logits: np.ndarray) -> np.ndarray:
    # -sum p log p in float64, apart from etjax's own entropy code: the independent truth.
    z = logits.astype(np.float64)
    log_p = z - z.max(-1, keepdims=True)
    log_p -= np.log(np.exp(log_p).sum(-1, keepdims=True))
    return -(np.exp(log_p) * log_p).sum(-1)


@pytest.fixture(scope="module")
def tiny(tiny_hf_dir):
    return etjax.load_model(tiny_hf_dir("llama"))


def _run(model, prompts, pruning: PruningConfig, new_tokens: int = 12, attention_backend="xla"):
    settings = [RequestSettings(max_new_tokens=new_tokens, ignore_eos=True)] * len(prompts)
    options = RuntimeOptions(
        page_size=4, steps_per_sync=4, pruning=pruning, attention_backend=attention_backend
    )
    return generate_ids(model.weights, model.config, model.tokenizer, prompts, settings, options)


@pytest.fixture(scope="module")
def three_prompts(tiny):
    # 37, 9 and 22 tokens: most tests run these three rows, so that they share the compiled
    # step programs of each pruning shape (a program per shape and row bucket).
    rng = np.random.default_rng(0)
    return [rng.integers(3, tiny.config.vocab_size, size=n).tolist() for n in (37, 9, 22)]


@pytest.fixture(scope="module")
def dense_three(tiny, three_prompts):
    """The XLA kernel's dense outputs of `three_prompts`, 12 tokens each, computed once: the
    truth of the keep-everything and the Pallas GPU dense tests."""
    return _run(tiny, three_prompts, PruningConfig())


@pytest.fixture(scope="module")
def low_budget_three(tiny, three_prompts):
    """The XLA kernel's pruned outputs of `three_prompts` under `LOW_BUDGET`, 6 tokens each
    (the programs of the keep-everything test's mass-ranking case serve them)."""
    return _run(tiny, three_prompts, LOW_BUDGET, new_tokens=6)


@pytest.mark.parametrize("share_heads, mass_threshold", [(True, 0.0), (False, 0.0), (True, 0.05)])
def test_pruning_that_keeps_everything_equals_dense(
    tiny, three_prompts, dense_three, share_heads, mass_threshold
):
    # min_fraction 1: the sparse path (bounds, selection, block-sparse attention, mass memory)
    # runs with every block kept and must reproduce the dense path.
    keep_all = _run(
        tiny,
        three_prompts,
        PruningConfig(
            enabled=True,
            min_fraction=1.0,
            share_heads=share_heads,
            mass_threshold=mass_threshold,
        ),
    )
    for a, b in zip(dense_three, keep_all, strict=True):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.entropy, b.entropy, rtol=1e-4, atol=1e-5)
        assert a.kept_blocks == b.kept_blocks  # all blocks, counted the same way


def test_low_budget_reads_fewer_blocks_and_costs_less(three_prompts, dense_three, low_budget_three):
    # LOW_BUDGET keeps max(ceil(0.3 x blocks), 3) of each step's blocks: the fraction for the
    # long rows (37 and 22 tokens and more: 10 and 6 blocks and more), the floor of 3 for the
    # short one (9 tokens: 3 and 4 blocks); without pruning every block is read.
    for prompt, dense, pruned in zip(three_prompts, dense_three, low_budget_three, strict=True):
        assert len(pruned.token_ids) == 6
        blocks = [-(-(len(prompt) + i + 1) // 4) for i in range(len(pruned.token_ids))]
        # The final token is not run through the model, so it reads nothing.
        assert pruned.kept_blocks[-1] == 0 and dense.kept_blocks[-1] == 0
        assert pruned.kept_blocks[:-1] == [max(int(np.ceil(0.3 * b)), 3) for b in blocks[:-1]]
        assert dense.kept_blocks[:5] == blocks[:5]
        assert pruned.cost_bytes[-1] < dense.cost_bytes[5]  # cumulative, after the same tokens


def test_decode_prunes_by_its_pruning_argument(tiny):
    # 121 prompt tokens in pages of 4: 31 blocks and more, of which the budget keeps
    # ceil(0.3 * blocks); without pruning every block is read.
    prompt, new = "The river " * 60, 6
    kwargs = dict(model=tiny, max_new_tokens=new, ignore_eos=True, page_size=4)
    (pruned,) = etjax.decode(prompt, pruning=LOW_BUDGET, **kwargs)
    (dense,) = etjax.decode(prompt, pruning=False, **kwargs)
    length = len(pruned.prompt_token_ids)
    blocks = [-(-(length + i + 1) // 4) for i in range(new - 1)]  # the last token reads none
    assert dense.kept_blocks[:-1] == blocks
    assert pruned.kept_blocks[:-1] == [max(int(np.ceil(0.3 * b)), 3) for b in blocks]
    assert pruned.cost_bytes[-1] < dense.cost_bytes[-1]
    with pytest.raises(RequestError, match="pruning="):
        etjax.decode(prompt, pruning="yes", **kwargs)


@pytest.mark.parametrize("backend", ["pallas_tpu", "pallas_gpu"])
def test_pruned_decode_runs_each_pallas_kernel_with_the_xla_outputs(
    tiny, three_prompts, low_budget_three, backend
):
    # The engine's pruned path through each Pallas kernel (interpret mode on this CPU) gives
    # the tokens and entropies of the XLA kernel, with a budget that really drops blocks.
    pallas = _run(tiny, three_prompts, LOW_BUDGET, new_tokens=6, attention_backend=backend)
    for a, b in zip(low_budget_three, pallas, strict=True):
        assert a.kept_blocks == b.kept_blocks and max(a.kept_blocks) < -(-43 // 4)
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.entropy, b.entropy, rtol=1e-4, atol=1e-5)


def test_auto_backend_follows_the_platform():
    # On a CPU the C++ decode kernel (tests/test_cpu_kernel.py), where it builds.
    assert resolve_backend("auto", "cpu") == AttentionBackend("cpu", interpret=False)
    assert resolve_backend("auto", "tpu") == AttentionBackend("pallas_tpu", interpret=False)
    assert resolve_backend("auto", "gpu") == AttentionBackend("pallas_gpu", interpret=False)
    assert resolve_backend("auto", "cuda") == AttentionBackend("pallas_gpu", interpret=False)
    # A Pallas kernel asked for on a CPU runs interpreted; XLA never is.
    assert resolve_backend("pallas_gpu", "cpu") == AttentionBackend("pallas_gpu", interpret=True)
    assert resolve_backend("pallas_tpu", "cpu") == AttentionBackend("pallas_tpu", interpret=True)
    assert resolve_backend("xla", "tpu") == AttentionBackend("xla", interpret=False)
    with pytest.raises(ValueError, match="attention_backend"):
        RuntimeOptions(attention_backend="triton")


def test_dense_decode_through_the_pallas_gpu_ragged_kernel_gives_the_xla_outputs(
    tiny, three_prompts, dense_three
):
    # The product path of a GPU: every dense step (mixed prefill + decode, and K-step bursts)
    # runs pallas_kernels/ragged_attention/pallas_gpu.py, interpreted on this CPU. Its 6
    # greedy tokens are the first 6 of the XLA kernel's 12, which the same steps computed.
    gpu = _run(tiny, three_prompts, PruningConfig(), new_tokens=6, attention_backend="pallas_gpu")
    for a, b in zip(dense_three, gpu, strict=True):
        assert a.token_ids[:6] == b.token_ids
        np.testing.assert_allclose(a.entropy[:6], b.entropy, rtol=1e-4, atol=1e-5)


def test_pruned_rows_in_a_ragged_step_decode_as_they_do_in_bursts(
    tiny, three_prompts, low_budget_three, monkeypatch
):
    # The 37-token prompt decodes while a 144-token one is still prefilling in 16-token
    # chunks: its pruned tokens then run inside ragged steps beside the chunks (dense chunk
    # attention, pruned row attention in one pass). In `low_budget_three` the same request
    # decodes in K-step bursts only (the three prompts prefill in one step). Both must keep
    # the same blocks and give the same tokens and entropies.
    from etjax.engine.device import DeviceBackend

    rows_per_step = []
    mixed = DeviceBackend.mixed

    def counting(self, rows, *args):
        rows_per_step.append(len(rows))
        return mixed(self, rows, *args)

    monkeypatch.setattr(DeviceBackend, "mixed", counting)
    short = three_prompts[0]
    long = np.random.default_rng(4).integers(3, tiny.config.vocab_size, size=144).tolist()
    # Nine chunks: the long prompt prefills through every step of the short one's decode (one
    # program), and stops at its first token, with no decode burst to compile.
    settings = [RequestSettings(max_new_tokens=n, ignore_eos=True) for n in (6, 1)]
    options = RuntimeOptions(page_size=4, steps_per_sync=4, prefill_chunk=16, pruning=LOW_BUDGET)
    together, _ = generate_ids(
        tiny.weights, tiny.config, tiny.tokenizer, [short, long], settings, options
    )
    in_bursts = low_budget_three[0]
    # Each of the short one's steps after its prefill (one a token) ran beside a chunk.
    assert rows_per_step.count(1) == len(together.token_ids), rows_per_step
    assert max(in_bursts.kept_blocks) < -(-43 // 4)  # blocks were really dropped
    assert together.kept_blocks == in_bursts.kept_blocks
    assert together.token_ids == in_bursts.token_ids
    np.testing.assert_allclose(together.entropy, in_bursts.entropy, rtol=1e-4, atol=1e-5)


def test_rows_pruning_one_document_select_it_together_and_read_it_once(tiny):
    # Four prompts after one 48-token beginning (12 pages of 4): with the prefix cache their
    # decode bursts hold its pages in common, and on the C++ kernel, asked to, they select
    # its blocks as a group (etjax/pruning/groups.py).
    rng = np.random.default_rng(12)
    beginning = rng.integers(3, tiny.config.vocab_size, 48).tolist()
    prompts = [
        beginning + rng.integers(3, tiny.config.vocab_size, k).tolist() for k in (1, 3, 6, 9)
    ]
    keep_all = PruningConfig(enabled=True, min_fraction=1.0, group_shared_prefixes=True)
    grouped = _run(tiny, prompts, keep_all, attention_backend="cpu")
    # Every block kept: the group's and each row's own are the whole context, so the grouped
    # steps must reproduce one full pass over prompt and output (padded at the end).
    sequences = [prompt + out.token_ids for prompt, out in zip(prompts, grouped, strict=True)]
    ids = np.zeros((4, max(map(len, sequences))), np.int32)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence)] = sequence
    logits = full_logits(tiny.weights, tiny.config, ids, page_size=4)
    for row, (prompt, out) in enumerate(zip(prompts, grouped, strict=True)):
        predicting = logits[row, len(prompt) - 1 : len(prompt) - 1 + len(out.token_ids)]
        np.testing.assert_array_equal(predicting.argmax(-1), out.token_ids)
        np.testing.assert_allclose(out.entropy, _entropy(predicting), rtol=1e-4, atol=1e-5)
        blocks = [-(-(len(prompt) + i + 1) // 4) for i in range(len(out.token_ids) - 1)]
        assert out.kept_blocks[:-1] == blocks  # all of them, the group's counted for each
        assert max(out.shared_blocks) == 12 * (1 - 1 / 4)  # read once for the four rows

    # 30% of every part: the group keeps ceil(0.3 x 12) = 4 of the beginning (read once for
    # four rows: each is spared 3), each row max(ceil(0.3 x t), 3) of its t pages after it.
    low = dataclasses.replace(LOW_BUDGET, group_shared_prefixes=True)
    pruned = _run(tiny, prompts, low, attention_backend="cpu")
    for prompt, out in zip(prompts, pruned, strict=True):
        grouped_steps = 0
        for i, (kept, spared) in enumerate(zip(out.kept_blocks, out.shared_blocks, strict=True)):
            if spared == 0:  # a step outside a grouped burst (a ragged step, the last token)
                continue
            tail = -(-(len(prompt) + i + 1) // 4) - 12
            assert kept == 4 + min(max(int(np.ceil(0.3 * tail)), 3), tail)
            assert spared == 3.0
            grouped_steps += 1
        assert grouped_steps >= 8
