"""A step's inputs built on the host (etjax/engine/step_inputs.py) and a new row's fields
(etjax/engine/row_store.py), checked by hand: no model, no device program. Page size 4 keeps
the arithmetic small enough to follow."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from etjax.attention import XLA
from etjax.engine.backend import PrefillJob
from etjax.engine.row_store import SETTINGS, new_row
from etjax.engine.step_inputs import StepGeometry, burst_inputs, mixed_inputs
from etjax.pruning.config import PruningConfig
from etjax.runtime.options import RequestSettings, RuntimeOptions

GEOMETRY = StepGeometry(
    page_size=4,
    pad_row=7,
    num_pages=32,
    max_seq_pages=8,
    pruned_table_width=8,
    prefill_rows=2,
    max_batch_size=4,
    token_budget=64,
    steps_per_sync=2,
    max_draft=3,
    prefix_cache=False,
    pruning=PruningConfig(),
    backend=XLA,
    window=0,
)


def test_mixed_step_lays_rows_then_drafts_then_chunks_in_one_flat_batch():
    # Row 2 has 5 cached tokens on pages [3, 9] and drafts [11, 12]; row 0 has 2 on page [5].
    # A chunk of 3 prompt tokens of the sequence on pages [20, 21] starts at position 3.
    job = PrefillJob(row=1, tokens=[40, 41, 42], start=3, pages=[20, 21], targets=[41, 42, -1])
    step = mixed_inputs(
        GEOMETRY,
        rows=[2, 0],
        pages=[[3, 9], [5]],
        lengths=[5, 2],
        budgets=[1.0, 1.0],
        jobs=[job],
        drafts=[[11, 12], []],
        speculating=False,
    )
    batch = step.batch
    # 3 + 1 + 3 = 7 tokens, padded to the smallest bucket, 8.
    assert batch.tokens.shape == (8,)
    # Slot 0: row 2's own token (sampled on the device, 0 here), then its drafts; slot 3: row
    # 0's token; slots 4-6 the chunk.
    np.testing.assert_array_equal(batch.tokens, [0, 11, 12, 0, 40, 41, 42, 0])
    np.testing.assert_array_equal(batch.positions, [5, 6, 7, 2, 3, 4, 5, 0])
    # Position p of a sequence is on its page p // 4; padding writes to the null page 0.
    np.testing.assert_array_equal(batch.write_pages, [9, 9, 9, 5, 20, 21, 21, 0])
    # With chunks the rows pad to max_batch_size (4), pad slots at the pad row and past T.
    np.testing.assert_array_equal(step.rows, [2, 0, 7, 7])
    np.testing.assert_array_equal(batch.decode_slot, [0, 3, 8, 8])
    np.testing.assert_array_equal(batch.draft_len, [2, 0, 0, 0])
    np.testing.assert_array_equal(batch.last_index, [6, 0])  # the chunk's last token
    np.testing.assert_array_equal(batch.targets, [-1, -1, -1, -1, 41, 42, -1, -1])
    assert step.row_tokens == 4
    assert step.max_draft == 3  # drafts present: this step verifies
    assert step.page_table is None and step.max_kept == 0  # dense


def test_mixed_step_without_drafts_or_speculation_verifies_nothing_and_pads_to_its_rows():
    step = mixed_inputs(GEOMETRY, [4], [[6]], [1], [1.0], [], [[]], speculating=False)
    assert step.max_draft == 0
    np.testing.assert_array_equal(step.rows, [4])  # no chunks: the rows' own bucket
    assert step.batch.last_index.shape == (0,)  # no prefill logits computed
    assert mixed_inputs(GEOMETRY, [4], [[6]], [1], [1.0], [], [[]], True).max_draft == 3


def test_a_verifying_step_alone_pads_to_its_own_bucket_and_checks_what_its_slots_hold():
    # One row and 1 draft: 2 slots, 1 draft checked; 2 drafts: 4 slots, 3 (the engine's
    # max_draft) checked. Two rows drafting 1 and 3: 6 tokens in 8 slots.
    one = mixed_inputs(GEOMETRY, [4], [[6]], [1], [1.0], [], [[9]], speculating=True)
    assert one.batch.tokens.shape == (2,) and one.max_draft == 1
    np.testing.assert_array_equal(one.batch.tokens, [0, 9])
    np.testing.assert_array_equal(one.batch.positions, [1, 2])
    two = mixed_inputs(GEOMETRY, [4], [[6]], [1], [1.0], [], [[9, 8]], speculating=True)
    assert two.batch.tokens.shape == (4,) and two.max_draft == 3
    rows = mixed_inputs(
        GEOMETRY, [4, 5], [[6], [7, 8]], [1, 2], [1.0] * 2, [], [[9], [8, 7, 3]], True
    )
    assert rows.batch.tokens.shape == (8,) and rows.max_draft == 3
    np.testing.assert_array_equal(rows.batch.decode_slot, [0, 2])
    # Beside a chunk the step pads as any ragged step, to 8 at least, with every draft slot.
    job = PrefillJob(row=1, tokens=[40], start=0, pages=[20])
    mixed = mixed_inputs(GEOMETRY, [4], [[6]], [1], [1.0], [job], [[9]], speculating=True)
    assert mixed.batch.tokens.shape == (8,) and mixed.max_draft == 3
    # Chunks alone have no row to verify: no draft slots, even in a speculating engine.
    alone = mixed_inputs(GEOMETRY, [], [], [], [], [job], [], speculating=True)
    assert alone.max_draft == 0 and alone.row_tokens == 0


@pytest.mark.parametrize(
    "rows, drafts, message",
    [
        ([0, 1, 2, 3, 4], [[]] * 5, "max_batch_size=4"),
        ([0], [[1, 2, 3, 4]], "max_draft=3"),
    ],
)
def test_mixed_step_refuses_what_the_engine_was_not_built_for(rows, drafts, message):
    pages = [[1]] * len(rows)
    with pytest.raises(ValueError, match=message):
        mixed_inputs(GEOMETRY, rows, pages, [1] * len(rows), [1.0] * len(rows), [], drafts, False)


def test_mixed_step_refuses_more_tokens_than_the_budget():
    job = PrefillJob(row=1, tokens=list(range(64)), start=0, pages=list(range(1, 17)))
    with pytest.raises(ValueError, match="65 tokens exceeds token_budget=64"):
        mixed_inputs(GEOMETRY, [0], [[1]], [1], [1.0], [job], [[]], False)


def test_dense_burst_tables_hold_only_the_pages_the_burst_writes():
    # Two steps from lengths 3 and 9: positions 3-4 (pages 0-1 of row 1's list) and 9-10
    # (page 2 of row 5's): each table starts at the page of its length, two columns wide.
    burst = burst_inputs(GEOMETRY, [1, 5], [[10, 11], [12, 13, 14]], [3, 9], [1.0, 1.0], num=4)
    np.testing.assert_array_equal(burst.rows, [1, 5, 7, 7])
    np.testing.assert_array_equal(burst.page_base, [0, 2, 0, 0])
    np.testing.assert_array_equal(burst.page_table[:2], [[10, 11], [14, 0]])
    assert burst.plan is not None and burst.groups is None and burst.max_kept == 0
    np.testing.assert_array_equal(burst.spared, [0.0, 0.0])  # no prefix cache, nothing shared


def test_pruned_burst_takes_whole_tables_and_a_kept_width():
    pruning = PruningConfig(enabled=True)
    geometry = dataclasses.replace(
        GEOMETRY, pruning=pruning, backend=dataclasses.replace(XLA, pruning=pruning.shape())
    )
    burst = burst_inputs(geometry, [1], [[10, 11, 12]], [9], [1.0], num=1)
    np.testing.assert_array_equal(burst.page_table, [[10, 11, 12, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(burst.page_base, [0])
    assert burst.plan is None  # no sliding-window layers: the pruned path reads everything
    assert 1 <= burst.max_kept <= geometry.pruned_table_width


def test_a_new_row_reads_the_device_fields_its_state_declares_from_the_settings():
    # DecodeState declares which of its fields come from a request's settings
    # (`from_settings`); the row store reads, inserts and empties exactly those.
    settings = RequestSettings(max_new_tokens=7, ignore_eos=True, logprobs=3)
    row = new_row(settings, [5, 9], 2, np.zeros(1, np.uint32), -1, 0.0, 0.0, 16, None)
    assert set(SETTINGS) == {"max_new_tokens", "stop_on_eos", "logprobs"}
    assert row.settings == {"max_new_tokens": 7, "stop_on_eos": False, "logprobs": 3}
    assert row.settings["max_new_tokens"].dtype == np.int32
    assert row.settings["stop_on_eos"].dtype == np.bool_
    np.testing.assert_array_equal(np.nonzero(row.in_prompt[0])[0], [5, 9])


def test_the_longest_page_list_follows_max_context_then_the_model_then_the_pool():
    # A model of 1,000 positions in pages of 16: 63 pages a sequence at most; max_context=100
    # bounds it at 7 (the attention work lists are sized from it); a pool of 40 pages (the
    # null page and 39) bounds it below both.
    from etjax.model.config import ModelConfig

    cfg = ModelConfig(
        vocab_size=8,
        hidden_size=8,
        intermediate_size=8,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        max_position_embeddings=1000,
    )

    def longest(num_pages: int, **options) -> int:
        opts = RuntimeOptions(page_size=16, **options)
        return StepGeometry.for_engine(cfg, opts, num_pages, XLA, max_draft=0).max_seq_pages

    assert longest(4096) == 63
    assert longest(4096, max_context=100) == 7
    assert longest(40) == 39 and longest(40, max_context=1000) == 39
