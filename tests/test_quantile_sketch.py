"""The batch summary's quantile sketch: within its stated relative error of the exact value at
the same rank (numpy's "lower" percentile), in memory that grows with the range of the values,
not with their number."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from etjax.jobs.quantile_sketch import TINY, QuantileSketch
from tests.hypothesis_profiles import examples

values = st.lists(
    st.one_of(st.just(0.0), st.floats(1e-6, 1e6, allow_nan=False)), min_size=1, max_size=300
)


@settings(max_examples=examples(200))
@given(values, st.floats(0.0, 1.0), st.sampled_from([0.01, 0.05, 0.2]))
def test_a_quantile_is_within_the_accuracy_of_the_exact_value_at_its_rank(xs, q, accuracy):
    sketch = QuantileSketch(accuracy)
    for x in xs:
        sketch.add(x)
    exact = float(np.percentile(xs, 100 * q, method="lower"))
    got = sketch.quantile(q)
    if exact <= TINY:
        assert got == 0.0
    else:
        assert abs(got - exact) <= accuracy * exact * (1 + 1e-9)


def test_memory_follows_the_range_not_the_count():
    sketch = QuantileSketch(0.01)
    rng = np.random.default_rng(0)
    for x in rng.uniform(1e-3, 86400.0, size=200_000):  # a millisecond to a day
        sketch.add(float(x))
    gamma = 1.01 / 0.99
    assert sketch.buckets <= math.log(86400.0 / 1e-3) / math.log(gamma) + 2
    assert sketch.count == 200_000


def test_empty_and_bad_input():
    sketch = QuantileSketch()
    assert sketch.quantile(0.5) == 0.0
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="non-negative"):
            sketch.add(bad)
    with pytest.raises(ValueError, match="q=2"):
        sketch.quantile(2)
