"""`StepCosts`: what a verifying step and a burst step cost on the machine the engine runs on.

The cost gate (rule.py, `verification_pays`) needs one number: how much a verifying ragged
step of a batch costs against one step of a decode burst over the same rows. The constants of
`SpeculationConfig` (`pass_fixed_tokens`, `verify_row_tokens`) were fitted on one CPU; on
another the ratio differs (docs/PERF.md, "What a verifying step costs against a burst step":
a one-row ragged step cost 2.05-2.22x a burst step on an AMD EPYC). So the engine times its
own steps and the gate reads the ratio measured here where it has one:

- a burst: its seconds over its steps, keyed by its row bucket (only bursts whose every step
  ran a row: a step after every row finished skips the model);
- a ragged step with drafts and no prefill chunk: its seconds, keyed by its row bucket and
  its token bucket (what the cost model prices it by), with the drafted positions it
  checked: a position is checked while some row still accepts (etjax/runtime/verify.py), and
  each costs a sampling and a commit (when each position also read the LM head, at batch 1
  on a 2-core CPU a step whose 7 drafts were all accepted cost 3.7 burst steps where one
  rejected at once cost about 2; with the head read once for all positions, a check is
  about 0.1 ms of CPU time there, and the count stays in the key for machines and batches
  where it is not). The gate asks for the positions it expects (rule.py,
  `expected_positions`), read off the measured ones by linear interpolation (clamped to the
  range measured).

A call during which JAX traced or compiled anything is not a sample (the compiler, not the
step; `compile_events`). Each key keeps its last `WINDOW` samples and is read as their median
once it has `MIN_SAMPLES`, so one slow call (another process on the machine) moves nothing.
A verifying shape not measured yet is priced from one measured at the same row bucket, scaled
by the cost model's ratio of the two token buckets; with no burst or no verifying step
measured at a row bucket, the constants decide.

A gate that turns drafts down on measured costs measures no verifying step after that, so
one inflated figure (a verifying step timed while other processes loaded the machine) would
keep it shut for the rest of the process. A row bucket's verifying figures are forgotten
after `STALE_BURSTS` bursts of it without one; the constants decide until it has been
measured again.

One table per process and model shape (`measured_costs`): engines built one after another in
a process (each `decode()` call builds one) start from what earlier ones measured.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Hashable, Mapping

from etjax.buckets import batch_bucket, next_power_of_two

WINDOW = 16  # samples kept per shape: the recent ones (the context grows, the cost with it)
MIN_SAMPLES = 2  # samples a shape needs before the gate reads it
# Bursts of a row bucket without a verifying step of it, after which its verifying figures
# are forgotten: at batch 1, 256 tokens; a gate shut on costs that hold pays the cost
# model's verifying steps (two, to measure again) once in that many bursts.
STALE_BURSTS = 32
# The fewest token slots a verifying step pads to: a lone row and one draft.
MIN_VERIFY_TOKENS = 2


def verify_token_bucket(num_tokens: int) -> int:
    """Padded token count of a verifying step without prefill chunks (its rows' tokens and
    drafts): a power of two from `MIN_VERIFY_TOKENS` up, where a step with chunks pads to
    8 at least (`ragged_token_bucket`). On a CPU with 4-bit weights a step's products cost
    with their rows (SmolLM2's at batch 1 on a 2-core Zen 4: 1, 2, 4 and 8 rows 14, 16, 20
    and 32 ms of CPU time, docs/PERF.md), so a lone row checking 1 or 3 drafts runs 2 or 4
    slots, not 8. At most two programs more per row bucket (2 and 4 tokens), only at the
    smallest batches."""
    return next_power_of_two(num_tokens, minimum=MIN_VERIFY_TOKENS)


class StepCosts:
    """Measured seconds of burst steps and verifying steps, by shape.

    burst, verify: a fixed table to start from (tests, or a table measured elsewhere), in
    seconds: `{row bucket: s}` per burst step and `{(row bucket, token bucket): s}` per
    verifying step. frozen: `record_*` are ignored, so the table stays as given (a gate whose
    decisions a test can work out by hand).
    """

    def __init__(
        self,
        burst: Mapping[int, float] | None = None,
        verify: Mapping[tuple[int, int], float] | None = None,
        frozen: bool = False,
    ) -> None:
        self.frozen = frozen
        self._burst: dict[int, deque[float]] = {}
        # (row bucket, token bucket) -> (positions checked, seconds) samples; a given table's
        # have no position count (0), and one count alone stands for every count.
        self._verify: dict[tuple[int, int], deque[tuple[int, float]]] = {}
        self._since_verify: dict[int, int] = {}  # row bucket -> bursts since its last verify
        for rows, seconds in (burst or {}).items():
            self._burst[rows] = deque([seconds] * MIN_SAMPLES, WINDOW)
        for shape, seconds in (verify or {}).items():
            self._verify[shape] = deque([(0, seconds)] * MIN_SAMPLES, WINDOW)

    def record_burst(self, rows: int, seconds_per_step: float) -> None:
        """One burst over `rows` rows took `seconds_per_step` per step."""
        if self.frozen:
            return
        bucket = batch_bucket(rows)
        self._burst.setdefault(bucket, deque(maxlen=WINDOW)).append(seconds_per_step)
        self._since_verify[bucket] = self._since_verify.get(bucket, 0) + 1
        if self._since_verify[bucket] >= STALE_BURSTS:
            self._since_verify[bucket] = 0
            for shape in [shape for shape in self._verify if shape[0] == bucket]:
                del self._verify[shape]

    def record_verify(self, rows: int, drafted: int, checked: int, seconds: float) -> None:
        """One ragged step of `rows` rows verifying `drafted` tokens (no prefill), which
        checked `checked` drafted positions, took `seconds`."""
        if not self.frozen:
            shape = (batch_bucket(rows), verify_token_bucket(rows + drafted))
            self._verify.setdefault(shape, deque(maxlen=WINDOW)).append((checked, seconds))
            self._since_verify[shape[0]] = 0

    def burst_seconds(self, rows: int) -> float | None:
        """A burst step over `rows` rows, in seconds; None until measured."""
        return _median(self._burst.get(batch_bucket(rows)))

    def verify_seconds(
        self, rows: int, drafted: int, model: Callable, checked: float = 0.0
    ) -> float | None:
        """A verifying step of `rows` rows and `drafted` drafts that checks `checked`
        drafted positions, in seconds: measured at its shape, else at the nearest measured
        token bucket of its row bucket scaled by `model(rows, tokens)` (the cost model's
        price of a step of that many tokens); None when no verifying step of its row bucket
        is measured."""
        bucket, tokens = batch_bucket(rows), verify_token_bucket(rows + drafted)
        exact = _at_positions(self._verify.get((bucket, tokens)), checked)
        if exact is not None:
            return exact
        measured = [
            (t, s)
            for (b, t), samples in self._verify.items()
            if b == bucket and (s := _at_positions(samples, checked)) is not None
        ]
        if not measured:
            return None
        near, seconds = min(measured, key=lambda m: abs(m[0] - tokens))
        return seconds * model(rows, tokens) / model(rows, near)

    def medians(self) -> dict[str, float]:
        """The seconds the gate reads for each shape measured enough (what a report shows)."""
        shapes = {f"burst step rows={b}": s for b, s in self._burst.items()}
        medians = {name: m for name, s in shapes.items() if (m := _median(s)) is not None}
        for (b, t), samples in self._verify.items():
            for checked, seconds in _by_positions(samples).items():
                medians[f"verify rows={b} tokens={t} checked={checked}"] = seconds
        return medians

    def samples(self) -> dict[str, int]:
        """How many samples each shape holds (what a report or a test can count)."""
        burst = {f"burst rows={b}": len(s) for b, s in self._burst.items()}
        verify = {f"verify rows={b} tokens={t}": len(s) for (b, t), s in self._verify.items()}
        return burst | verify


def _median(samples: deque[float] | None) -> float | None:
    if not samples or len(samples) < MIN_SAMPLES:
        return None
    return statistics.median(samples)


def _by_positions(samples: deque[tuple[int, float]] | None) -> dict[int, float]:
    # The median seconds at each count of positions checked that has MIN_SAMPLES samples of
    # its own; while none has, the median of them all, for any count (none before
    # MIN_SAMPLES). A count seen once is one call's figure, and under load one ragged call
    # can take several times its usual time.
    if not samples or len(samples) < MIN_SAMPLES:
        return {}
    by = {}
    for count in sorted({checked for checked, _ in samples}):
        seconds = [s for k, s in samples if k == count]
        if len(seconds) >= MIN_SAMPLES:
            by[count] = statistics.median(seconds)
    return by or {0: statistics.median(s for _, s in samples)}


def _at_positions(samples: deque[tuple[int, float]] | None, checked: float) -> float | None:
    # The seconds at `checked` positions: interpolated between the nearest measured counts,
    # the nearest one's outside their range.
    by = _by_positions(samples)
    if not by:
        return None
    counts = list(by)
    below = [c for c in counts if c <= checked]
    above = [c for c in counts if c >= checked]
    if not below or not above:
        return by[counts[0] if not below else counts[-1]]
    lo, hi = below[-1], above[0]
    if lo == hi:
        return by[lo]
    return by[lo] + (checked - lo) / (hi - lo) * (by[hi] - by[lo])


_TABLES: dict[Hashable, StepCosts] = {}


def measured_tables() -> dict[Hashable, StepCosts]:
    """Every table this process measured, by its key (`measured_costs`)."""
    return dict(_TABLES)


def measured_costs(key: Hashable) -> StepCosts:
    """This process's table for the engines of one model shape and backend (`key`: whatever
    changes what a step costs: the model config, attention backend, KV dtype, pruning,
    mesh, draft width)."""
    return _TABLES.setdefault(key, StepCosts())


class _CompileEvents:
    # A count of JAX's tracing, lowering and compiling events in this process (monitoring
    # listeners, registered once): a device call during which it moved compiled something.
    count = 0
    listening = False

    @classmethod
    def on_event(cls, event: str, *_, **__) -> None:
        if event.startswith(("/jax/core/compile/", "/jax/compilation_cache/")):
            cls.count += 1


def compile_events() -> int:
    """JAX trace, lowering, compile and compilation-cache events in this process so far (a
    call that moved this count compiled, and its time is no step's cost)."""
    if not _CompileEvents.listening:
        import jax.monitoring

        jax.monitoring.register_event_duration_secs_listener(_CompileEvents.on_event)
        jax.monitoring.register_event_listener(_CompileEvents.on_event)
        _CompileEvents.listening = True
    return _CompileEvents.count
