"""`Sequence`: the host's record of one request from arrival to its last token.

It owns what the device does not: the request's settings and priority, its pages, where its
prefill stands, the streamed text (stop strings are found here), the trace of the entropy
signal, and the timestamps its metrics come from.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from etjax.cache.prefix_cache import CachedPage
from etjax.drafting import DraftHistory, TokenHistory
from etjax.runtime.options import TRACE_FIELDS, RequestSettings, SequenceOutput
from etjax.tokenizer import IncrementalDetokenizer


class Status(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    PREFILLING = "prefilling"  # admitted: pages held, prompt chunks being run
    RUNNING = "running"  # resident: decodes whenever the scheduler picks it
    FINISHED = "finished"


@dataclass
class Sequence:
    """One request. `order` is its arrival rank, the tie-breaker of every policy."""

    order: int
    prompt: list[int]
    settings: RequestSettings
    priority: float = 0.0
    arrival_time: float = 0.0
    status: Status = Status.WAITING
    row: int = -1  # resident row on the device, -1 when not resident
    pages: list[int] = field(default_factory=list)
    # The indexed pages among them (the first len(held)): its shared prefix and the pages it
    # published for others (etjax/cache/prefix_cache.py).
    held: list[CachedPage] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens its first admission found in the prefix cache
    prefilled: int = 0  # tokens of `context` already in the cache
    context: list[int] = field(default_factory=list)  # what prefill must cache
    output: SequenceOutput = field(default_factory=SequenceOutput)
    detokenizer: IncrementalDetokenizer | None = None
    saved_row: object = None  # the device row of a preempted sequence, restored on return
    recompute_flops: float = 0.0  # prefill cost to be added when the row is (re)inserted
    recompute_bytes: float = 0.0
    cancelled: bool = False
    preemptions: int = 0
    last_run_round: int = -1
    admitted_round: int = -1
    waiting_since: int = 0  # round it (re)entered the queue: aging counts from here
    resident_round: int = -1  # round its context was last fully prefilled
    finish_round: int = -1
    budget: float = 1.0  # kept-block fraction its next decode step may read
    drafts: DraftHistory | None = None  # how its speculation fared (speculation on)
    history: TokenHistory = field(default_factory=TokenHistory)  # prompt + output, for lookup
    decode_passes: int = 0  # model passes that gave it tokens (speculation: < tokens)
    grammar: int = -1  # its constraint's matcher id (etjax/constraints/matcher.py), or -1
    # Its last token (its first, drawn by the step that ran its prompt's last chunk) is
    # committed and streamed but not yet run: its row's next step runs it.
    token_pending: bool = False
    # Metrics, in the engine's clock.
    admitted_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    pending_text: list[str] = field(default_factory=list)  # streamed, not yet consumed

    @property
    def length(self) -> int:
        """The prompt and every generated token: the tokens in the cache once resident,
        where no token is pending (`cache_length`)."""
        return len(self.prompt) + len(self.output.token_ids)

    @property
    def cache_length(self) -> int:
        """Tokens its KV pages hold once resident: `length`, less a pending token."""
        return self.length - self.token_pending

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def accept(self, token: int, trace: tuple[float, ...], finish: str = "") -> bool:
        """Record a sampled token and its trace (values in TRACE_FIELDS order) and what the
        device says it ended ("eos", "length" or "": FINISH_REASONS); return whether the
        sequence continues. The text's stop strings are the host's to find."""
        out = self.output
        out.token_ids.append(token)
        for name, value in zip(TRACE_FIELDS, trace, strict=True):
            getattr(out, name).append(value)
        if finish == "eos":  # its text is not the output's
            out.finish_reason = finish
            return False
        # Without a tokenizer (host-logic tests) there is no text, only token ids.
        if self.detokenizer is not None and self.emit(self.detokenizer.push(token)):
            return False
        if finish:
            out.finish_reason = finish
            return False
        return True

    def emit(self, piece: str) -> bool:
        """Append text; cut it at a stop string the new piece completes (returns True then)."""
        out = self.output
        if not piece:
            return False
        before = len(out.text)
        out.text += piece
        for stop in self.settings.stop:
            at = out.text.find(stop, max(0, before - len(stop) + 1))
            if at >= 0:
                out.text = out.text[:at]
                out.finish_reason = "stop"
                piece = out.text[before:]
                break
        if piece:
            self.pending_text.append(piece)
        return out.finish_reason == "stop"

    def close(self, reason: str = "") -> None:
        """Flush the detokenizer and set the finish reason if none was set yet."""
        out = self.output
        if out.finish_reason != "stop" and self.detokenizer is not None:
            self.emit(self.detokenizer.flush())
        if not out.finish_reason:
            out.finish_reason = reason or "length"
        self.status = Status.FINISHED

    def recent_entropy_drop(self, window: int) -> float | None:
        """Mean dH+ = max(0, H_{t-1} - H_t) over the last `window` tokens of the entropy
        signal (the calibrated entropy, the model's own without a calibration); None before
        two."""
        h = self.output.calibrated_entropy[-(window + 1) :]
        if len(h) < 2:
            return None
        return float(np.mean(np.maximum(np.diff(h) * -1.0, 0.0)))
