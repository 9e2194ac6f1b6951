"""`etjax.plot` draws the trace it is given."""

from __future__ import annotations

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")

from etjax.api import Result
from etjax.errors import EtjaxError
from etjax.plot import plot_trace


def _result(offset: float) -> Result:
    n = 6
    return Result(
        token_ids=list(range(n)),
        entropy=[offset + i for i in range(n)],
        sampled_entropy=[offset + 0.5 * i for i in range(n)],
        temperature=[0.7] * n,
        tau=[0.1 * i for i in range(n)],
    )


def test_one_panel_per_field_one_line_per_result(tmp_path):
    results = [_result(0.0), _result(1.0)]
    figure = plot_trace(results, labels=["a", "b"])
    axes = figure.axes
    assert len(axes) == 4
    np.testing.assert_array_equal(axes[0].lines[1].get_ydata(), results[1].entropy)
    np.testing.assert_array_equal(axes[3].lines[0].get_ydata(), results[0].tau)
    figure.savefig(tmp_path / "trace.png")
    assert (tmp_path / "trace.png").stat().st_size > 1000


def test_unknown_field_is_named():
    with pytest.raises(EtjaxError, match="unknown trace field 'entropyy'"):
        plot_trace(_result(0.0), fields=["entropyy"])
