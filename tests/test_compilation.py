"""Static shapes: after warm-up, prompts of new lengths must not trigger recompilation."""

from __future__ import annotations

import numpy as np
import pytest

import etjax
from etjax.engine.build import RequestSettings, RuntimeOptions, generate_ids
from etjax.pruning.config import PruningConfig
from etjax.sampling import SamplerSettings
from tests.compile_counter import counting_new_programs


@pytest.fixture
def backend_compiles():
    """A counter of programs new to this process (compiled, or read from the run's cache)."""
    with counting_new_programs() as count:
        yield count


PRUNED = PruningConfig(
    enabled=True, min_fraction=0.3, entropy_low=50.0, entropy_high=60.0, min_blocks=3
)


@pytest.mark.parametrize(
    "page_size, num_pages, pruning", [(16, 64, PruningConfig()), (4, 160, PRUNED)]
)
def test_no_recompilation_after_warmup(
    tiny_hf_dir, backend_compiles, page_size, num_pages, pruning
):
    # Pruned: pages of 4, so the rows' page counts (3 to 16) and kept counts differ between
    # the runs; neither may shape a program.
    model = etjax.load_model(tiny_hf_dir("llama"))
    rng = np.random.default_rng(0)

    # A fixed pool: the shapes under test are those the prompts and budgets set.
    options = RuntimeOptions(num_pages=num_pages, page_size=page_size, pruning=pruning)

    def run(lengths: list[int], max_new: list[int]) -> None:
        prompts = [rng.integers(3, model.config.vocab_size, size=n).tolist() for n in lengths]
        settings = [
            RequestSettings(max_new_tokens=m, sampler=SamplerSettings(temperature=0.7))
            for m in max_new
        ]
        generate_ids(model.weights, model.config, model.tokenizer, prompts, settings, options)

    # Warm-up: the four prompts are prefilled as one flat batch of 73 tokens (bucket 128), and
    # finish one by one, so decode batches of 4, 3 (bucket 4), 2 and 1 rows all run.
    run([9, 20, 14, 30], max_new=[8, 16, 24, 32])
    warm = backend_compiles[0]
    assert warm > 0
    # New lengths, new order, other token budgets: every shape falls in a warmed bucket (the
    # prefill's by total tokens, 81 and 71; attention plans by the pool, not the lengths).
    run([27, 25, 18, 11], max_new=[30, 12, 6, 20])
    run([12, 25, 31, 3], max_new=[13, 13, 13, 13])
    # Longer contexts than any warm-up row (up to 100 tokens, 25 pages of 4), the same buckets.
    run([60, 30, 20, 10], max_new=[40, 8, 8, 8])
    assert backend_compiles[0] == warm


def test_pruning_thresholds_are_read_at_run_time_not_compiled_in(tiny_hf_dir, backend_compiles):
    # Two engines whose pruning differs only in its numbers run the same programs, and each
    # row reads the blocks its own thresholds give (the host's formula, per token).
    import dataclasses

    from etjax.pruning.budget import kept_block_count, kept_fraction

    model = etjax.load_model(tiny_hf_dir("llama"))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, model.config.vocab_size, size=n).tolist() for n in (30, 21)]
    settings = [RequestSettings(max_new_tokens=12, ignore_eos=True)] * 2
    ramp = dataclasses.replace(
        PRUNED,
        min_fraction=0.25,
        entropy_low=0.0,
        entropy_high=40.0,
        sink_blocks=1,
        recent_blocks=1,
        min_blocks=1,
        mass_threshold=0.05,
    )

    def run(pruning):
        options = RuntimeOptions(num_pages=160, page_size=4, pruning=pruning)
        outs = generate_ids(
            model.weights, model.config, model.tokenizer, prompts, settings, options
        )
        for prompt, out in zip(prompts, outs, strict=True):
            blocks = (len(prompt) + np.arange(len(out.token_ids) - 1)) // 4 + 1
            entropy = np.asarray(out.entropy[:-1], np.float32)
            expected = kept_block_count(kept_fraction(entropy, pruning), blocks, pruning, xp=np)
            assert out.kept_blocks[:-1] == expected.tolist()
        return [out.kept_blocks for out in outs]

    first = run(PRUNED)
    warm = backend_compiles[0]
    assert run(ramp) != first  # the other numbers were read
    assert backend_compiles[0] == warm
