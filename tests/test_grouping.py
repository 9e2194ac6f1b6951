"""`split_by_width`: the cheapest cut of a batch into bursts, against brute force."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from etjax.engine.grouping import split_by_width
from tests.hypothesis_profiles import examples


def _cost(weight):
    return lambda group: weight + len(group) * max(group)


def _brute_force(widths, weight, max_groups):
    # Every way to cut the sorted widths into at most max_groups contiguous groups.
    ordered = sorted(widths)
    n = len(ordered)
    best = None
    for groups in range(1, min(max_groups, n) + 1):
        for cuts in itertools.combinations(range(1, n), groups - 1):
            bounds = [0, *cuts, n]
            parts = [ordered[a:b] for a, b in itertools.pairwise(bounds)]
            total = sum(_cost(weight)(p) for p in parts)
            if best is None or total < best[0] - 1e-9:
                best = (total, parts)
    return best


@settings(max_examples=examples(200), deadline=None)
@given(
    st.lists(st.integers(1, 500), min_size=1, max_size=9),
    st.sampled_from([0.0, 10.0, 300.0, 1e6]),
    st.integers(1, 4),
)
def test_split_matches_brute_force(widths, weight, max_groups):
    groups = split_by_width(widths, lambda w: w, _cost(weight), max_groups)
    total = sum(_cost(weight)(g) for g in groups)
    expected, _ = _brute_force(widths, weight, max_groups)
    assert abs(total - expected) < 1e-6
    assert sorted(itertools.chain(*groups)) == sorted(widths)
    assert 1 <= len(groups) <= max_groups


def test_split_by_hand():
    # 100 + 4 * 90 = 460 as one burst; (100 + 3 * 6) + (100 + 90) = 308 as two.
    assert split_by_width([6, 90, 6, 6], lambda w: w, _cost(100.0), 4) == [[6, 6, 6], [90]]
    # With weights of 1000 the second burst costs more than it saves.
    assert split_by_width([6, 90, 6, 6], lambda w: w, _cost(1000.0), 4) == [[6, 6, 6, 90]]
    assert split_by_width([6, 90], lambda w: w, _cost(0.0), 1) == [[6, 90]]
    assert split_by_width([], lambda w: w, _cost(0.0), 4) == []
