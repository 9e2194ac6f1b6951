"""ROUGE-L of the fidelity benchmarks, against values computed by hand."""

from __future__ import annotations

import pytest

from benchmarks.text_metrics import longest_common_subsequence, rouge_l, words


def test_words_split_on_punctuation_and_lowercase():
    assert words("The Pass-key is 68234!") == ["the", "pass", "key", "is", "68234"]


def test_lcs_by_hand():
    # "a b c d e" vs "a c e f": a, c, e in order -> 3.
    assert longest_common_subsequence(list("abcde"), list("acef")) == 3
    assert longest_common_subsequence(list("abc"), list("cba")) == 1
    assert longest_common_subsequence([], list("abc")) == 0


def test_rouge_l_by_hand():
    # Candidate 4 words, reference 7; the LCS is all 4 candidate words (police ... killed the
    # gunman): P = 1, R = 4/7, F = 2 * (4/7) / (11/7) = 8/11.
    score = rouge_l("police killed the gunman", "police kill the gunman killed the gunman")
    assert score == pytest.approx(8 / 11)
    assert rouge_l("the cat sat", "the cat sat") == 1.0
    assert rouge_l("dogs bark", "cats meow") == 0.0
    assert rouge_l("", "") == 1.0 and rouge_l("", "word") == 0.0
    p, r = 4 / 4, 4 / 5
    assert rouge_l("police killed the gunman", "the police killed the gunman") == pytest.approx(
        2 * p * r / (p + r)
    )
