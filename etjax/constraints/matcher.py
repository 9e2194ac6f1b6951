"""Host-side grammar state of constrained rows, and the callback the device step calls.

Each constrained request owns an llguidance matcher, registered under an integer id that its
device row carries (`DecodeState.grammar`; -1 for an unconstrained row). After every draw the
decode step hands the drawn tokens to `start_advance` (through `jax.experimental.io_callback`,
etjax/runtime/token_mask.py), which queues `advance` on a host thread and returns at once:
each constrained row's matcher consumes its token and computes the bitmask of the tokens
allowed next while the device runs the model; after the model's pass the step collects the
masks (`collect_advance`) and applies them before the next draw. The registry is keyed by id,
not by row, so a preempted row keeps its grammar state wherever it is readmitted, and
programs compiled once serve every engine (the callback finds matchers by id).

`advance` is idempotent per token: it is given each token's index in the row's output and
skips what its matcher already consumed, so a re-executed callback cannot advance a grammar
twice.

The masks a step asked for wait in one slot between its two callbacks, never more: the
callbacks are ordered, so a step collects its masks before the next step asks, and a program
that fails between them leaves its masks there only until the next step's request replaces
them. Nothing builds up behind failed steps, and a collect takes only its own step's masks.

A constraint llguidance cannot serve is found as early as it can be: at `register` (the
engine's submit), a matcher that fails to compile, or whose first masks fail (over the tokens
its grammar forces), is a `FieldError` naming the field (`refusal`); one that fails only while
generating, after which its mask allows only end-of-sequence, ends its request with finish
reason "error" (`failure`, read by the engine when the row finishes), never "eos": under a
constraint, "eos" means that the output satisfies it.

`forced_tokens` lists the tokens the grammar forces next (llguidance's fast-forward tokens), which
the engine drafts so that a run of them costs one pass (etjax/drafting/forced.py);
`valid_prefix` cuts a constrained row's lookup draft to what the grammar allows. A verifying
step calls `advance` once per drafted position with `only_committed`: rows whose draft was not
committed there keep the mask they had, so the host computes masks only where one changed.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from etjax.constraints.grammar import grammar_text
from etjax.errors import FieldError, RequestError

ALL_TOKENS = 0xFFFFFFFF  # a mask word allowing all 32 of its tokens
# The most forced tokens `refusal` follows at submit: llguidance's failures on a grammar's
# forced start (a row past its limits, an infinite recursion) show within the first one.
PROBE_TOKENS = 4
REASON_CHARS = 200  # of llguidance's error message (which appends its whole parser state)


def mask_words(vocab_size: int) -> int:
    """uint32 words of a bitmask over `vocab_size` tokens (bit i of word i // 32 = token i)."""
    return (vocab_size + 31) // 32


class RowGrammar:
    """One request's matcher and how many of its output tokens it has consumed."""

    def __init__(self, matcher, vocab_size: int) -> None:
        self.matcher, self.vocab_size = matcher, vocab_size
        self.consumed = 0

    def mask(self) -> np.ndarray:
        """[W] uint32 the tokens allowed next (none past the vocabulary)."""
        words = np.frombuffer(self.matcher.compute_bitmask(), np.uint32)
        return _fit(words, mask_words(self.vocab_size))

    def consume(self, index: int, token: int) -> None:
        """Take output token `index` (ignored if already taken)."""
        if index != self.consumed:
            return
        self.consumed += 1
        # A token outside the mask cannot be drawn; an error state would show as an empty mask.
        self.matcher.consume_token(token)


def _fit(words: np.ndarray, width: int) -> np.ndarray:
    # llguidance's mask covers its tokenizer; the model's vocabulary may be padded beyond it.
    out = np.zeros(width, np.uint32)
    n = min(width, words.shape[0])
    out[:n] = words[:n]
    return out


_registry: dict[int, RowGrammar] = {}
_ids = itertools.count()
_lock = threading.Lock()
_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_executor = None  # llguidance's thread pool for masks of several rows, made on first use
# The thread `start_advance` queues the steps' `advance` on: one, so the matchers take their
# tokens in the order the device drew them. Made on first use.
_worker: ThreadPoolExecutor | None = None
# (ticket, the masks `collect_advance` returns) of the one step between its callbacks.
_in_flight: tuple[int, Future] | None = None
_tickets = itertools.count()


def _ll_tokenizer(tokenizer, vocab_size: int):
    # Building one reads the whole vocabulary (about 0.5 s for 49K tokens): once per tokenizer.
    import llguidance

    cached = _tokenizers.get(tokenizer)
    if cached is None or cached[0] != vocab_size:
        eos = list(tokenizer.eos_token_ids) or None
        built = llguidance.LLTokenizer(
            tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=eos
        )
        cached = (vocab_size, built)
        _tokenizers[tokenizer] = cached
    return cached[1]


def register(kind: str, value, tokenizer, vocab_size: int) -> int:
    """A fresh matcher for a request's constraint; returns its id. A constraint llguidance
    cannot serve, as far as its first masks show (`refusal`), is a `FieldError` naming the
    field (`kind`) and llguidance's reason."""
    import llguidance

    if tokenizer is None:
        raise RequestError("a constrained request needs the model's tokenizer")
    matcher = llguidance.LLMatcher(
        _ll_tokenizer(tokenizer, vocab_size), grammar_text(kind, value), log_level=0
    )
    why = refusal(matcher, set(tokenizer.eos_token_ids))
    if why is not None:
        raise FieldError(kind, value, f"a constraint llguidance can generate from ({why})")
    with _lock:
        gid = next(_ids)
        _registry[gid] = RowGrammar(matcher, vocab_size)
    return gid


def reason(matcher) -> str:
    """llguidance's error on one line, without the parser state it appends, cut to
    REASON_CHARS."""
    text = " ".join(matcher.get_error().split("<state>")[0].split())
    return text if len(text) <= REASON_CHARS else f"{text[:REASON_CHARS]}..."


def refusal(matcher, eos: set[int]) -> str | None:
    """Why llguidance cannot serve a fresh matcher's constraint, as its first masks show, or
    None. A grammar that fails to compile, or whose first mask fails, has an empty language
    or hits a limit of llguidance's (a `$ref` cycle, a row of over 2000 choices, a grammar
    whose only strings are infinite); so does one that fails within the first PROBE_TOKENS
    tokens it forces, which every output must take. Without this such a request would
    generate an end-of-sequence token at once (all a failed matcher's mask allows). Probed on
    a copy: the matcher itself consumes nothing."""
    if matcher.is_error():
        return reason(matcher)
    probe, eos_ids = matcher.deep_copy(), np.fromiter(eos, np.int64)
    for taken in range(PROBE_TOKENS + 1):
        bits = np.frombuffer(probe.compute_bitmask(), np.uint8)
        allowed = np.flatnonzero(np.unpackbits(bits, bitorder="little"))
        after = "at its first token" if taken == 0 else f"after {taken} forced token"
        after += "s" * (taken > 1)
        if probe.is_error():
            why = reason(probe)
            if why.startswith("NoExtensionBias"):  # llguidance's name for it
                why = f"no token can continue the output ({why})"
            return f"{after}: {why}"
        free = allowed[~np.isin(allowed, eos_ids)]
        if not free.size and not probe.is_accepting():
            return f"{after}: it allows no token, and no output is complete"
        if free.size != 1 or free.size < allowed.size or taken == PROBE_TOKENS:
            return None  # a choice (or an end) the model makes: not a certain failure
        probe.consume_token(int(free[0]))
    return None


def failure(gid: int, finish: str) -> str | None:
    """Why a constrained request's output, ended by `finish` (a finish reason), fails its
    constraint, or None: llguidance's error, which its matcher met while generating (after
    one a mask allows only end-of-sequence, which must not read as a complete output), or,
    for an output ended by end-of-sequence, a grammar that was not in an accepting state."""
    row = _registry.get(gid)
    if row is None:
        return None
    m = row.matcher
    if m.is_error():
        return f"llguidance failed while generating: {reason(m)}"
    if finish == "eos" and not (m.is_accepting() or m.is_stopped()):
        return "generation ended where no output is complete"
    return None


def initial_mask(gid: int) -> np.ndarray:
    """[W] uint32 the tokens a request's first output token may be."""
    return _registry[gid].mask()


def forced_tokens(gid: int) -> list[int]:
    """The tokens a request's grammar forces next, in order (llguidance's fast-forward tokens:
    the forced bytes as tokens, short of a last token a longer one could replace); empty when
    the next token is free. Drafts, not commitments: the step verifies them under the real
    masks, so one the mask would not force costs its rejection, never a different output."""
    row = _registry.get(gid)
    return [] if row is None else list(row.matcher.compute_ff_tokens())


def valid_prefix(gid: int, tokens: list[int]) -> int:
    """How many of `tokens`, in order, the request's grammar would take next (llguidance's
    `validate_tokens`: nothing is consumed). What cuts a lookup draft of a constrained row
    to the part its masks could accept (etjax/drafting/forced.py)."""
    row = _registry.get(gid)
    return 0 if row is None or not tokens else int(row.matcher.validate_tokens(list(tokens)))


def release(gid: int) -> None:
    """Forget a finished request's matcher."""
    with _lock:
        _registry.pop(gid, None)


def live_count() -> int:
    """Matchers registered and not released (for tests)."""
    return len(_registry)


def pending() -> bool:
    """Whether a step's masks were asked for and not collected (for tests): only while a
    step runs, or after a program that failed between its callbacks, until the next step."""
    return _in_flight is not None


def advance(
    gids: np.ndarray,
    tokens: np.ndarray,
    index: np.ndarray,
    committed: np.ndarray,
    width: int,
    only_committed: bool = False,
) -> np.ndarray:
    """What the host does for a step's draw (queued by `start_advance`). gids, tokens,
    index: [B] int32 (the token's index in the row's output), committed: [B] bool. Returns
    [B, width] uint32: for each constrained row the tokens allowed after its committed token,
    all ones for the others (and, with `only_committed`, for rows that committed nothing:
    the caller keeps their mask)."""
    # A callback's arguments are jax Arrays: indexing one dispatches an op (about 0.15 ms),
    # and four per row made a step's callback 22 ms for 32 rows; NumPy views cost nothing.
    gids, tokens, index, committed = (np.asarray(a) for a in (gids, tokens, index, committed))
    masks = np.full((gids.shape[0], width), ALL_TOKENS, np.uint32)
    rows = (gids >= 0) & committed if only_committed else gids >= 0
    live = []
    for b in np.nonzero(rows)[0]:
        row = _registry.get(int(gids[b]))
        if row is None:  # a pad row's stale id, or a request already released
            continue
        if committed[b]:
            row.consume(int(index[b]), int(tokens[b]))
        live.append((int(b), row))
    _fill_masks(live, masks)
    return masks


def start_advance(
    gids, tokens, index, committed, width: int, only_committed: bool = False
) -> np.ndarray:
    """The first of the step's two callbacks: queue `advance` with these arguments (as
    `advance` takes them) on the host thread and return its ticket ([] int32) for
    `collect_advance` at once, so the masks are computed while the device runs the model."""
    global _worker, _in_flight
    # Copies: the device may reuse its buffers once this returns.
    args = [np.array(a) for a in (gids, tokens, index, committed)]
    with _lock:
        if _worker is None:
            _worker = ThreadPoolExecutor(1, thread_name_prefix="etjax-masks")
        ticket = next(_tickets) % 2**31
        # Whatever is in the slot was asked for by a program that failed before collecting
        # it: dropped. (The one worker still runs it first, so the matchers see their tokens
        # in order; a token consumed twice by index is skipped.)
        _in_flight = (
            ticket,
            _worker.submit(advance, *args, width=width, only_committed=only_committed),
        )
    return np.int32(ticket)


def collect_advance(ticket: np.ndarray) -> np.ndarray:
    """The second callback: the masks of `start_advance`'s `ticket`, waiting for them if
    the host has not finished ([B, width] uint32, as `advance` returns)."""
    global _in_flight
    ticket = int(np.asarray(ticket))
    with _lock:
        if _in_flight is None or _in_flight[0] != ticket:  # ordered callbacks rule this out
            raise RuntimeError(f"no masks pending for ticket {ticket}: callbacks out of order")
        future, _in_flight = _in_flight[1], None
    return future.result()


def _fill_masks(live: list[tuple[int, RowGrammar]], masks: np.ndarray) -> None:
    # masks[b] = row b's next mask. llguidance computes the rows' masks on threads of its own
    # (32 rows of a JSON schema: 1.1 ms against 3.2 one by one, alone on this project's
    # 2-core CPU), which a host with cores to spare gives the model's pass back sooner; one at
    # a time where its mask is narrower than the model's vocabulary needs (`_fit`).
    if len(live) < 2 or any(
        row.matcher.is_error() or mask_words(row.vocab_size) != masks.shape[1] for _, row in live
    ):
        for b, row in live:
            masks[b] = row.mask()
        return
    import llguidance.numpy

    global _executor
    if _executor is None:
        _executor = llguidance.LLExecutor()
    llguidance.numpy.fill_next_token_bitmask_par(
        _executor, [(row.matcher, b) for b, row in live], masks.view(np.int32)
    )
