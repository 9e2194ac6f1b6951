"""The ablation's figures, as PNG files: per-token traces of sample requests, latency CDFs and
throughput bars. matplotlib draws off-screen (the Agg backend); pip install 'etjax[bench]'.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from etjax.errors import EtjaxError

# trace field -> axis label
TRACES = {
    "entropy": "model entropy (nats)",
    "temperature": "temperature",
    "kept_fraction": "blocks read (fraction)",
}


def write_plots(raw: dict, directory: Path, samples: int = 3) -> list[Path]:
    """Draw every figure of `raw` into `directory`; the paths written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise EtjaxError("plots need matplotlib: pip install 'etjax[bench]'") from None
    directory.mkdir(parents=True, exist_ok=True)
    return [
        _traces(plt, raw, directory / "traces.png", samples),
        _latency_cdf(plt, raw, directory / "latency_cdf.png"),
        _throughput(plt, raw, directory / "throughput.png"),
    ]


def sample_requests(raw: dict, samples: int) -> list[int]:
    # The first requests of distinct kinds, so short and long prompts both show.
    chosen, kinds = [], set()
    for i, request in enumerate(raw["workload"]):
        if request["kind"] not in kinds:
            kinds.add(request["kind"])
            chosen.append(i)
    return sorted(chosen, key=lambda i: raw["workload"][i]["kind"] != "long")[:samples]


def _traces(plt, raw: dict, path: Path, samples: int) -> Path:
    chosen = sample_requests(raw, samples)
    fig, axes = plt.subplots(
        len(TRACES), len(chosen), figsize=(4.5 * len(chosen), 2.4 * len(TRACES)), squeeze=False
    )
    for col, i in enumerate(chosen):
        request = raw["workload"][i]
        for row, (field, label) in enumerate(TRACES.items()):
            ax = axes[row][col]
            for name, runs in raw["runs"].items():
                ax.plot(runs[0]["requests"][i]["traces"][field], label=name, linewidth=0.8)
            if row == 0:
                ax.set_title(f"request {i} ({request['kind']})", fontsize=9)
            if col == 0:
                ax.set_ylabel(label, fontsize=8)
            if row == len(TRACES) - 1:
                ax.set_xlabel("generated token", fontsize=8)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _latency_cdf(plt, raw: dict, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, runs in raw["runs"].items():
        latency = np.sort([r["end_to_end_latency"] for run in runs for r in run["requests"]])
        ax.step(latency, np.arange(1, len(latency) + 1) / len(latency), label=name, where="post")
    if raw.get("reference"):
        latency = np.sort([r["end_to_end_latency"] for r in raw["reference"]["requests"]])
        ax.step(
            latency,
            np.arange(1, len(latency) + 1) / len(latency),
            label="transformers generate",
            where="post",
            linestyle="--",
        )
    ax.set_xlabel("end-to-end latency (s)")
    ax.set_ylabel("fraction of requests")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _throughput(plt, raw: dict, path: Path) -> Path:
    names = list(raw["summary"])
    values = [[s["throughput_tok_s"] for s in raw["summary"][n]] for n in names]
    if raw.get("reference"):
        names.append("transformers")
        values.append([raw["reference"]["throughput_tok_s"]])
    median = [float(np.median(v)) for v in values]
    errors = [
        [m - min(v) for m, v in zip(median, values, strict=True)],
        [max(v) - m for m, v in zip(median, values, strict=True)],
    ]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(names, median, yerr=errors, capsize=4, color="tab:blue")
    ax.set_ylabel("generated tokens / s (median, min-max)")
    ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
