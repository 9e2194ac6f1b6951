"""What a padded row costs a decode burst, against compiling a burst for fewer rows (SmolLM2).

When a batch drains (rows finish), its row bucket shrinks and the next burst is a new program.
`DeviceBackend.burst_rows` keeps a short tail in a bucket it already runs instead; its
`PADDED_ROW_STEPS` weighs the padded rows against the compile. This measures both: one
greedy request decoded with its bursts forced to each width (1, 2, 4, 8, 32 rows), in one
process without the persistent cache, so each width's first burst compiles. Reports the
first burst (compile included), the warm bursts' median and spread, the cost of a padded
row-step as a fraction of a one-row step, and how many padded row-steps one compile is worth.
Writes the "burst_padding" section of docs/PERF.md.

    .venv/bin/python benchmarks/burst_padding.py [--bursts 25]
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.perf_report import machine_line, write_section

WIDTHS = (1, 2, 4, 8, 32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bursts", type=int, default=25, help="decode bursts per width")
    args = parser.parse_args()
    os.environ["ETJAX_COMPILATION_CACHE"] = "off"  # every width's first burst compiles here
    import etjax

    model = etjax.load_model()
    results = {w: _bursts(model, w, args.bursts) for w in WIDTHS}
    _report(results, args)


def _bursts(model, width: int, bursts: int) -> list[float]:
    # Seconds of each decode burst of one request, its bursts forced to `width` rows.
    from etjax.engine.device import DeviceBackend
    from etjax.engine_build import MIN_POOL_PAGES, build_engine
    from etjax.runtime.options import RequestSettings, RuntimeOptions

    options = RuntimeOptions()
    engine = build_engine(model.weights, model.config, model.tokenizer, options, MIN_POOL_PAGES)
    backend = engine.backend
    seconds, decode = [], DeviceBackend.decode

    def timed(*call, **kwargs):
        started = time.perf_counter()
        out = decode(backend, *call, **kwargs)  # reads its outputs back: nothing is pending
        seconds.append(time.perf_counter() - started)
        return out

    backend.burst_rows = lambda num_rows, tokens_left: width
    backend.decode = timed
    prompt = model.tokenizer.encode("The history of the river valley begins with")
    settings = RequestSettings(max_new_tokens=options.steps_per_sync * bursts + 1, ignore_eos=True)
    engine.generate([prompt], [settings])
    print(width, f"first {seconds[0]:.2f} s, warm median {np.median(seconds[2:]) * 1e3:.1f} ms")
    return seconds


def _report(results: dict[int, list[float]], args) -> None:
    steps = 8
    one = np.median(results[1][2:]) / steps
    lines = [
        "## Padded rows in a decode burst (SmolLM2)",
        "",
        f"Measured {datetime.date.today()} on {machine_line()}. Command: `.venv/bin/python "
        f"benchmarks/burst_padding.py {shlex.join(sys.argv[1:])}`. One greedy request, its "
        f"{args.bursts} bursts of {steps} steps forced to each width, no persistent cache; "
        "warm bursts exclude the first two. A padded row-step costs the fraction of a "
        "one-row step in the fifth column; one compile is worth the last column of them.",
        "",
        "| rows | first burst s | warm burst ms (median) | spread ms "
        "| padded row-step / one-row step | compile = padded row-steps |",
        "|---|---|---|---|---|---|",
    ]
    raw = {"machine": machine_line(), "date": str(datetime.date.today()), "seconds": {}}
    for width, seconds in results.items():
        warm = np.asarray(seconds[2:])
        compile_s = seconds[0] - np.median(warm)
        if width == 1:
            extra, worth = "", ""
        else:
            per_row = (np.median(warm) / steps - one) / (width - 1)
            extra = f"{per_row / one:.3f}"
            worth = f"{compile_s / per_row:.0f}" if per_row > 0 else "n/a"
        lines.append(
            f"| {width} | {seconds[0]:.2f} | {1000 * np.median(warm):.1f} | "
            f"{1000 * warm.min():.1f}-{1000 * warm.max():.1f} | {extra} | {worth} |"
        )
        raw["seconds"][str(width)] = seconds
    write_section("burst_padding", "\n".join(lines), raw)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
