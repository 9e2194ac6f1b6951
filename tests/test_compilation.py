"""Static shapes: after warm-up, prompts of new lengths must not trigger recompilation."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import etjax
from etjax.engine_build import RequestSettings, RuntimeOptions, build_engine, generate_ids
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
    # the runs; neither may shape a program, nor may the pruning thresholds.
    model = etjax.load_model(tiny_hf_dir("llama"))
    rng = np.random.default_rng(0)

    def run(lengths: list[int], max_new: list[int], pruning: PruningConfig = pruning) -> None:
        # A fixed pool: the shapes under test are those the prompts and budgets set.
        options = RuntimeOptions(num_pages=num_pages, page_size=page_size, pruning=pruning)
        prompts = [rng.integers(3, model.config.vocab_size, size=n).tolist() for n in lengths]
        settings = [
            RequestSettings(max_new_tokens=m, sampler=SamplerSettings(temperature=0.7))
            for m in max_new
        ]
        outs = generate_ids(
            model.weights, model.config, model.tokenizer, prompts, settings, options
        )
        if pruning.enabled:  # each row read the blocks its thresholds give, token by token
            for prompt, out in zip(prompts, outs, strict=True):
                assert out.kept_blocks[:-1] == _kept_by_hand(len(prompt), out, pruning, page_size)

    # Warm-up: the four prompts are prefilled as one flat batch of 73 tokens (bucket 128), and
    # finish one by one, so decode batches of 4, 3, 2 and 1 rows all run (the short tails in
    # the 4-row program: DeviceBackend.burst_rows).
    run([9, 20, 14, 30], max_new=[8, 16, 24, 32])
    warm = backend_compiles[0]
    assert warm > 0
    # New lengths, new order, other token budgets: every shape falls in a warmed bucket (the
    # prefill's by total tokens, 81 and 71; attention plans by the pool, not the lengths).
    run([27, 25, 18, 11], max_new=[30, 12, 6, 20])
    run([12, 25, 31, 3], max_new=[13, 13, 13, 13])
    # Longer contexts than any warm-up row (up to 100 tokens, 25 pages of 4), the same buckets;
    # pruned, under other thresholds (traced, not compiled in) that keep other block counts.
    other = dataclasses.replace(
        pruning,
        min_fraction=0.25,
        entropy_low=0.0,
        entropy_high=40.0,
        min_blocks=1,
        recent_blocks=1,
        mass_threshold=0.05,
    )
    run([60, 30, 20, 10], max_new=[40, 8, 8, 8], pruning=other if pruning.enabled else pruning)
    assert backend_compiles[0] == warm


def _kept_by_hand(prompt_length: int, out, pruning: PruningConfig, page_size: int) -> list[int]:
    # The budget of each token but the last (which is not run): the ramp of the entropy it
    # was drawn from between the thresholds, of the blocks its context then fills, rounded up,
    # with the floors (PruningConfig's docstring), in float32 as the step computes it.
    blocks = (prompt_length + np.arange(len(out.token_ids) - 1)) // page_size + 1
    entropy = np.asarray(out.entropy[:-1], np.float32)
    ramp = (entropy - np.float32(pruning.entropy_low)) / np.float32(
        pruning.entropy_high - pruning.entropy_low
    )
    low = np.float32(pruning.min_fraction)
    fraction = low + (np.float32(1) - low) * np.clip(ramp, 0, 1)
    floor = max(pruning.min_blocks, pruning.sink_blocks + pruning.recent_blocks)
    wanted = np.ceil(fraction * blocks.astype(np.float32))
    return np.minimum(np.maximum(wanted, floor), blocks).astype(int).tolist()


def test_a_drained_batch_runs_its_short_tail_in_a_bucket_it_has(tiny_hf_dir, monkeypatch):
    # Four rows that finish one burst apart: the tail of 3, 2 and 1 rows stays in the 4-row
    # program (a few padded rows cost less than compiling a program per bucket), and each
    # row's tokens are those it gets alone, in 1-row bursts.
    import etjax.engine.device as device
    from etjax.engine.device import PADDED_ROW_STEPS

    model = etjax.load_model(tiny_hf_dir("llama"))
    bursts = []  # (rows, padded rows) of each decode burst
    decode, decode_steps = device.DeviceBackend.decode, device.decode_steps

    def recording_decode(self, rows, *args):
        bursts.append([len(rows)])
        return decode(self, rows, *args)

    def recording_steps(weights, cache, store, rows, *args, **kwargs):
        bursts[-1].append(len(rows))
        return decode_steps(weights, cache, store, rows, *args, **kwargs)

    monkeypatch.setattr(device.DeviceBackend, "decode", recording_decode)
    monkeypatch.setattr(device, "decode_steps", recording_steps)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, model.config.vocab_size, size=n).tolist() for n in (5, 9, 7, 12)]
    settings = [RequestSettings(max_new_tokens=m, ignore_eos=True) for m in (9, 17, 25, 33)]

    def run(prompts, settings):
        return generate_ids(model.weights, model.config, model.tokenizer, prompts, settings)

    together = run(prompts, settings)
    assert {rows for rows, _ in bursts} == {4, 3, 2, 1}
    assert {padded for _, padded in bursts} == {4}
    bursts.clear()
    for prompt, setting, out in zip(prompts, settings, together, strict=True):
        (alone,) = run([prompt], [setting])
        assert out.token_ids == alone.token_ids
    assert {padded for _, padded in bursts} == {1}

    # By hand: a tail pads into the smallest bucket run so far while the padded row-steps
    # stay within PADDED_ROW_STEPS; a longer tail gets its own bucket, kept from then on.
    backend = build_engine(model.weights, model.config, model.tokenizer, RuntimeOptions()).backend
    limit = PADDED_ROW_STEPS // 3
    assert backend.burst_rows(4, None) == 4
    assert backend.burst_rows(1, limit) == 4  # 3 padded rows x limit tokens
    assert backend.burst_rows(1, limit + 1) == 1
    assert backend.burst_rows(1, 5) == 1  # its own bucket exists now
    assert backend.burst_rows(2, None) == 2  # unknown length: never padded
    assert backend.burst_rows(3, 1000) == 4
