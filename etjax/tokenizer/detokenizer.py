"""Streaming detokenization: token ids in, finished text out, never half a character.

Byte-level BPE tokens are byte strings, so one character (an emoji, a CJK ideograph) can be split
across tokens; decoding such a prefix yields U+FFFD. Sentencepiece decoders also depend on
context (the leading space of the first token is stripped). ``IncrementalDetokenizer`` therefore
decodes a short window of recent ids twice -- the already-emitted context alone, and the context
plus the new ids -- and emits the difference once it no longer ends in U+FFFD.

Why the pieces add up to ``tokenizer.decode(all_ids)``: the window only advances past a point
where the decoded text ended on a complete character, and a UTF-8 decoder holds no state there,
so decoding the stream in segments split at such points equals decoding it whole. The context
window keeps prefix-dependent decoders (a stripped leading space) consistent.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from etjax.tokenizer.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a stream of token ids into text pieces, one ``push`` per generated token.

    ``push(id)`` returns the text completed by that id ("" while a character is still partial),
    ``flush()`` returns whatever is held back at the end of the stream and resets the
    detokenizer for a new stream. The concatenation of all returned pieces equals
    ``tokenizer.decode(ids, skip_special_tokens)``. Per-token cost is two decodes of a window of
    a few ids: the ids before the window are dropped.

    ``max_pending`` bounds how many ids may be held back. A valid UTF-8 character needs at most
    four byte tokens, so the bound is only reached by a stream of invalid bytes; the held text is
    then emitted with its U+FFFD, and only in that invalid case can the number of U+FFFD differ
    from a whole decode.
    """

    def __init__(
        self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False, max_pending: int = 16
    ) -> None:
        if max_pending < 4:
            raise ValueError(f"max_pending must be >= 4 (a UTF-8 character), got {max_pending}")
        self._decode = tokenizer.backend.decode
        self._skip_special_tokens = skip_special_tokens
        self._max_pending = max_pending
        self._reset()

    def _reset(self) -> None:
        # _ids[:_read] is emitted text kept as decoding context; _ids[_read:] is pending.
        self._ids: list[int] = []
        self._read = 0

    def _window_texts(self) -> tuple[str, str]:
        context = self._decode(
            self._ids[: self._read], skip_special_tokens=self._skip_special_tokens
        )
        full = self._decode(self._ids, skip_special_tokens=self._skip_special_tokens)
        return context, full

    def push(self, token_id: int) -> str:
        """Add one generated id. Returns the newly completed text, possibly ""."""
        self._ids.append(int(token_id))
        context, full = self._window_texts()
        pending = len(self._ids) - self._read
        complete = len(full) > len(context) and not full.endswith(_REPLACEMENT)
        if not complete and pending <= self._max_pending:
            return ""
        piece = full[len(context) :]
        # The emitted ids become the next window's context; older ids are no longer needed.
        self._ids = self._ids[self._read :]
        self._read = len(self._ids)
        return piece

    def extend(self, token_ids: Iterable[int]) -> str:
        """Push several ids. Returns the concatenated newly completed text."""
        return "".join(self.push(token_id) for token_id in token_ids)

    def flush(self) -> str:
        """End the stream. Returns the held-back tail (with U+FFFD for an unfinished character)
        and resets the detokenizer so the next ``push`` starts a new stream.
        """
        context, full = self._window_texts()
        self._reset()
        return full[len(context) :]

    @property
    def pending(self) -> int:
        """Number of pushed ids whose text has not been emitted yet."""
        return len(self._ids) - self._read
