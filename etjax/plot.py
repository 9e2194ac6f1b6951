"""Plots of the per-token entropy trace for notebooks (`pip install etjax[plot]`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from etjax.errors import EtjaxError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from etjax.api import Result

# field -> (axis label, unit)
TRACE_FIELDS = {
    "entropy": ("entropy of the distribution drawn from (T = 1)", "nats"),
    "raw_entropy": ("model entropy, whole vocabulary (T = 1)", "nats"),
    "calibrated_entropy": ("calibrated entropy (the engine's signal)", "nats"),
    "sampled_entropy": ("sampled entropy", "nats"),
    "temperature": ("temperature", ""),
    "tau": ("entropic time tau", "nats"),
    "cost_bytes": ("cumulative bytes read", "bytes"),
}
# What `plot_trace` draws unless told otherwise, and what the bench keeps for its plots.
DEFAULT_FIELDS = ("entropy", "sampled_entropy", "temperature", "tau")


def plot_trace(
    results: Result | Sequence[Result],
    fields: Sequence[str] = DEFAULT_FIELDS,
    labels: Sequence[str] | None = None,
) -> Figure:
    """Draw each trace field of one or several results against the token index.

    One panel per field, one line per result (labelled by `labels` or its index). Returns the
    matplotlib Figure; in a notebook it displays itself.
    """
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        raise EtjaxError(
            "etjax.plot needs matplotlib: pip install 'etjax[plot]' (or matplotlib)"
        ) from None
    items = [results] if hasattr(results, "token_ids") else list(results)
    unknown = [f for f in fields if f not in TRACE_FIELDS]
    if unknown:
        raise EtjaxError(f"unknown trace field {unknown[0]!r}; allowed: {sorted(TRACE_FIELDS)}")
    names = list(labels) if labels is not None else [f"request {i}" for i in range(len(items))]
    figure, axes = plt.subplots(
        len(fields), 1, sharex=True, figsize=(8, 1.9 * len(fields)), squeeze=False
    )
    for ax, name in zip(axes[:, 0], fields, strict=True):
        label, unit = TRACE_FIELDS[name]
        for result, line_label in zip(items, names, strict=True):
            ax.plot(getattr(result, name), label=line_label, linewidth=1.2)
        ax.set_ylabel(f"{label}\n({unit})" if unit else label, fontsize=8)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("generated token")
    if len(items) > 1:
        axes[0, 0].legend(fontsize=7, loc="upper right")
    figure.tight_layout()
    return figure
