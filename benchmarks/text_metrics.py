"""Text similarity for fidelity benchmarks: ROUGE-L between a candidate and a reference text.

Words are lowercase runs of letters and digits (punctuation separates them), as in the
reference ROUGE scripts' default tokenizer without stemming.
"""

from __future__ import annotations

import re

_WORD = re.compile(r"[a-z0-9]+")


def words(text: str) -> list[str]:
    """The lowercase alphanumeric words of `text`."""
    return _WORD.findall(text.lower())


def longest_common_subsequence(a: list[str], b: list[str]) -> int:
    """Length of the longest common subsequence of two word lists (O(len(a) * len(b)))."""
    if not a or not b:
        return 0
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0]
        for j, y in enumerate(b):
            current.append(previous[j] + 1 if x == y else max(previous[j + 1], current[j]))
        previous = current
    return previous[-1]


def rouge_l(candidate: str, reference: str) -> float:
    """ROUGE-L F1 of `candidate` against `reference`: 1 when identical, 0 with no common word.

    Two empty texts are identical (1.0); one empty text against a non-empty one scores 0.
    """
    c, r = words(candidate), words(reference)
    if not c and not r:
        return 1.0
    lcs = longest_common_subsequence(c, r)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(c), lcs / len(r)
    return 2 * precision * recall / (precision + recall)
