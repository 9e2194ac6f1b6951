"""`Backend`: what the engine needs from a device, and the little it hands over.

The engine (engine.py) decides which sequences run and owns their pages on the host; a backend
executes. `DeviceBackend` (device.py) runs the model's jitted programs; the mock of
tests/engine_mock.py computes outputs by hand. Neither is imported by the engine: it is given
one, typed by this Protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from etjax.runtime.options import RequestSettings

if TYPE_CHECKING:
    from etjax.runtime.state import StepOutputs


@dataclass(frozen=True)
class PrefillJob:
    """One chunk of a sequence's context to append to its pages."""

    row: int
    tokens: list[int]
    start: int  # position of tokens[0]
    pages: list[int]  # the sequence's pages (covering start + len(tokens))
    # For prompt log-probabilities: the context token after each of `tokens`, -1 where none
    # is asked for; None when the sequence asks for none.
    targets: list[int] | None = None


@dataclass(frozen=True)
class RowInit:
    """What a row needs when its sequence becomes resident (first time or after preemption)."""

    prompt: list[int]
    generated: list[int]
    settings: RequestSettings
    saved: object  # what `Backend.save` returned when the row was preempted, or None
    prefill_flops: float
    prefill_bytes: float
    grammar: int = -1  # the id of its constraint's matcher (etjax/constraints), -1 for none
    # A new row (`saved` None) draws and commits its first token on insert, from its
    # prompt's logits, as its first decode step would; it holds the token pending: its next
    # step runs it (the length the host passes then is the cache's, one less than the
    # sequence's). `Backend.first_tokens` hands the token over.
    draw: bool = False


class BurstEstimate(Protocol):
    """What a decode burst reads, estimated on the host for the grouping (grouping.py);
    the device's is `BurstCost` (etjax/engine/burst_cost.py)."""

    def row_width(self, length: int, budget: float) -> int:
        """The attention width a row reads at this length and budget."""

    def burst_bytes(self, lengths: list[int], budgets: list[float]) -> float:
        """Bytes one burst over rows of these lengths and budgets reads."""


class Backend(Protocol):
    num_pages: int  # the KV pool, page 0 (the null page) included
    vocab_size: int  # token ids a prompt may hold: [0, vocab_size)
    # The most tokens (prompt and output) a request may come to: the options' max_context,
    # else the model's context.
    context_limit: int
    burst_cost: BurstEstimate  # what a burst reads, for the grouping
    # Whether `insert` draws a new row's first token (`RowInit.draw`; the engine asks only
    # then).
    draws_first_tokens: bool

    def mixed(
        self,
        rows: list[int],
        pages: list[list[int]],
        lengths: list[int],
        budgets: list[float],
        jobs: list[PrefillJob],
        drafts: list[list[int]] | None = None,
    ) -> tuple[StepOutputs | None, np.ndarray, list[tuple[float, float]], list[np.ndarray | None]]:
        """One step: `rows` decode a token each (at their budget fractions, under pruning),
        `jobs` append their chunks, and (speculation on) each row's `drafts` are run after its
        token and verified. Returns the rows' outputs [steps, len(rows)] (emitted where a
        token was committed), their next budget fractions, each job's (FLOPs, bytes), and
        for each job with `targets` the log-probability of each target after its token
        (float [len(tokens)], T = 1; None for a job without targets)."""

    def decode(
        self,
        rows: list[int],
        pages: list[list[int]],
        lengths: list[int],
        budgets: list[float],
        tokens_left: int | None = None,
    ) -> tuple[StepOutputs, np.ndarray, np.ndarray]:
        """A burst of decode steps; the outputs [K, len(rows)], the next budget fractions and
        per row the blocks a step read once for its group of rows sharing a prefix, less the
        row's share of them (etjax/attention/cascade.py `blocks_read_for_others`; zeros
        where nothing is shared). `tokens_left`: the most tokens any of the rows may still
        produce (None: unknown), which a device may use to choose the burst's padded shape."""

    def insert(self, row: int, init: RowInit) -> None:
        """Make `row` resident once its context is fully prefilled."""

    def first_tokens(self, rows: list[int]) -> tuple[StepOutputs, np.ndarray]:
        """The first tokens `rows` drew when inserted (`RowInit.draw`), outputs
        [1, len(rows)], and their budget fractions [len(rows)]."""

    def fork(self, source: int, row: int, pages: list[int], copy: tuple[int, int] | None) -> None:
        """Give `row` (whose sequence has the same context and holds `pages`) the result of
        `source`'s prefill, which just completed and is not inserted yet: its last logits,
        and where its last page is partly filled, that page's keys and values copied
        (`copy` = (source's page, row's page)). `insert(row, ...)` follows."""

    def save(self, row: int) -> object:
        """The row's state, to restore on readmission after a preemption."""

    def release(self, row: int) -> None:
        """Forget the row (finished, cancelled or preempted)."""
