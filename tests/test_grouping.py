"""`split_by_width`: the cheapest cut of a batch into bursts, against brute force; and the
device's burst cost, which decides where a pruned batch is cut."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import etjax
from cpp_kernels import cpu_kernels_available
from etjax.engine.device import DeviceBackend
from etjax.engine.grouping import split_by_width
from etjax.pruning.config import PruningConfig
from etjax.runtime.options import RuntimeOptions
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


def _burst_cost(device, rows):
    return device.burst_cost.burst_bytes([n for n, _ in rows], [b for _, b in rows])


@pytest.fixture(scope="module")
def tiny(tiny_hf_dir):
    return etjax.load_model(tiny_hf_dir("llama"))


@pytest.mark.parametrize("backend", ["cpu", "xla"])
def test_pruned_bursts_split_only_where_the_kernel_pads_rows(tiny, backend):
    # The C++ kernels read each pruned row's own kept blocks and score its own pages, so a
    # long row beside short ones costs them nothing and splitting the burst would only read
    # the weights again; the XLA loop runs every row to the largest kept count.
    if backend == "cpu" and not cpu_kernels_available():
        pytest.skip("the C++ kernels do not build here")
    options = RuntimeOptions(
        page_size=4, pruning=PruningConfig(enabled=True), attention_backend=backend
    )
    device = DeviceBackend(tiny.weights, tiny.config, (0,), options, num_pages=2048)
    rows = [(n, b) for n in (8, 60, 700, 2000) for b in (0.2, 1.0)]
    short, long = (8, 1.0), (2000, 1.0)
    beside_long = _burst_cost(device, [short, long])
    if backend == "cpu":
        assert beside_long < _burst_cost(device, [long, long])
        for a, b in itertools.combinations(rows, 2):
            assert _burst_cost(device, [a, b]) <= _burst_cost(device, [a]) + _burst_cost(
                device, [b]
            )
    else:  # the short row reads (and scores) as much as the long one
        assert beside_long == _burst_cost(device, [long, long])
