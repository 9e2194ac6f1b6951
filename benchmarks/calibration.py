"""Calibration of the entropy signal on held-out text, before and after a fitted temperature.

For each model: the temperature is fitted (etjax/calibrate/fit.py, optax L-BFGS on the
mean NLL) to the first `--tokens` scored positions of some Lee articles, and measured on
`--tokens` positions of other articles it never saw (windows of `--window` tokens, each from
an empty cache): next-token NLL, the expected calibration error of the top token (15 bins),
the mean gap between the entropy and the realised surprisal, and that gap over 15 equal-count
entropy bins (the entropy's own calibration error). A monotone map from entropy to expected
surprisal (isotonic regression on the fit text, after the temperature) is measured the same
way, to see whether it earns a place beside the temperature. Then pruning at the default
setting: teacher-forced perplexity of long documents' last tokens through the decode path
(etjax/bench/perplexity.py), on documents of articles the fit never saw: dense; with budgets
from the raw entropy; from the calibrated one under the unshifted ramp; from the calibrated
one under the ramp moved by the shift fitted with it (etjax/calibration/ramp.py, on the fit
text: what `etjax calibrate` writes and the engine applies); and from the raw entropy with its
ramp moved until it keeps what that paired run keeps (secant search), the comparison at equal
kept fraction. Per-document paired differences of log perplexity carry a standard error, so
a reader can see whether a difference is resolved. Writes the "calibration" section of
docs/PERF.md.

    .venv/bin/python benchmarks/calibration.py [--models smollm2-135m-instruct,gemma3-270m]
        [--tokens 2048] [--pruning-docs 8] [--pruning-length 2048]
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.perf_report import machine_line, write_section

FIT_ARTICLES = slice(0, 100)
HELD_ARTICLES = slice(150, 250)
PRUNING_ARTICLES = slice(100, 300)  # the long documents: never the fit text


def isotonic(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pool-adjacent-violators: the nondecreasing step function of x closest to y in squared
    error, as knots (x values, fitted y) for np.interp."""
    order = np.argsort(x, kind="stable")
    xs, ys = x[order], y[order].astype(np.float64)
    means, weights, ends = [], [], []
    for i, v in enumerate(ys):
        means.append(v)
        weights.append(1.0)
        ends.append(i)
        while len(means) > 1 and means[-2] > means[-1]:
            w = weights[-2] + weights[-1]
            m = (means[-2] * weights[-2] + means[-1] * weights[-1]) / w
            means[-2:], weights[-2:], ends[-2:] = [m], [w], [ends[-1]]
    starts = [0] + [e + 1 for e in ends[:-1]]
    knots_x = np.array([(xs[s] + xs[e]) / 2 for s, e in zip(starts, ends, strict=True)])
    return knots_x, np.array(means)


def _shifted(delta: float):
    # The default pruning with its entropy ramp moved by delta nats.
    from etjax.pruning.config import PruningConfig

    d = PruningConfig()
    return PruningConfig(
        enabled=True, entropy_low=d.entropy_low + delta, entropy_high=d.entropy_high + delta
    )


def paired_difference(a: dict, b: dict) -> dict:
    """Per-document difference of log(ppl ratio) of run `a` minus run `b` (= the difference
    of their mean NLLs): mean, standard error over documents, and each document's value."""
    diff = np.log(np.array(a["ppl"])) - np.log(np.array(b["ppl"]))
    se = float(diff.std(ddof=1) / np.sqrt(diff.size)) if diff.size > 1 else float("nan")
    return {"mean": float(diff.mean()), "se": se, "per_document": diff.tolist()}


def equal_kept(run, target: float, start: dict, steps: int, tolerance: float = 2e-3) -> dict:
    """The raw signal's run (`run(shift)`) whose ramp shift makes it keep `target`: secant
    steps on kept fraction against shift from the unshifted run `start` (kept fraction is
    smooth and decreasing in the shift), the closest run found."""
    points = [(0.0, start)]
    shift = -0.4 if start["kept_fraction"] < target else 0.4
    best = start
    # The unshifted run is never taken as the answer without one search step: a shift that
    # lands closer (as it usually does) replaces it.
    for _ in range(steps):
        r = run(shift)
        r["shift"] = shift
        points.append((shift, r))
        if abs(r["kept_fraction"] - target) < abs(best["kept_fraction"] - target):
            best = r
        if abs(r["kept_fraction"] - target) < tolerance:
            break
        (s0, r0), (s1, r1) = points[-2], points[-1]
        slope = (r1["kept_fraction"] - r0["kept_fraction"]) / (s1 - s0)
        if slope >= 0:  # flat or noisy: halve towards the start instead
            shift = s1 / 2
        else:
            shift = float(np.clip(s1 + (target - r1["kept_fraction"]) / slope, -4.0, 4.0))
    best.setdefault("shift", 0.0)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2-135m-instruct,gemma3-270m")
    parser.add_argument("--tokens", type=int, default=2048, help="scored positions per set")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--pruning-docs", type=int, default=8, help="0 skips pruning")
    parser.add_argument("--pruning-length", type=int, default=2048)
    parser.add_argument("--secant-steps", type=int, default=3, help="equal-kept search")
    args = parser.parse_args()

    import etjax
    from etjax.bench.corpus import lee_articles
    from etjax.bench.perplexity import long_documents, perplexity, prefill_documents
    from etjax.calibrate.fit import fit_temperature, teacher_forced, text_statistics
    from etjax.calibrate.metrics import entropy_gap, summarise, token_statistics
    from etjax.calibration.ramp import ramp_shift
    from etjax.pruning.budget import kept_fraction
    from etjax.pruning.config import PruningConfig

    articles = lee_articles()
    fit_texts, held_texts = articles[FIT_ARTICLES], articles[HELD_ARTICLES]
    results = {}
    for name in args.models.split(","):
        model = etjax.load_model(name, dtype="float32")
        started = time.perf_counter()
        logits, targets = teacher_forced(model, fit_texts, args.window, args.tokens)
        forward_s = time.perf_counter() - started
        started = time.perf_counter()
        fit = fit_temperature(logits, targets)
        fit_s = time.perf_counter() - started
        t = fit.temperature
        fit_stats = token_statistics(jnp.asarray(logits), jnp.asarray(targets), jnp.float32(t))
        fit_stats = {k: np.asarray(v) for k, v in fit_stats.items()}
        fit_raw = token_statistics(jnp.asarray(logits), jnp.asarray(targets), jnp.float32(1.0))
        fit_raw_entropy = np.asarray(fit_raw["entropy"])
        del logits, fit_raw
        # The ramp paired with the calibration, on the fit text (what `etjax calibrate` writes).
        shift = ramp_shift(fit_raw_entropy, fit_stats["entropy"])
        raw, calibrated = text_statistics(model, held_texts, [1.0, t], args.window, args.tokens)
        row = {
            "temperature": t,
            "iterations": fit.iterations,
            "fit_tokens": int(targets.size),
            "fit_nll_before": fit.nll_before,
            "fit_nll_after": fit.nll_after,
            "ramp_shift": shift,
            "fit_ramp_kept": {
                "raw": float(np.mean(kept_fraction(fit_raw_entropy, PruningConfig(), np))),
                "calibrated": float(
                    np.mean(kept_fraction(fit_stats["entropy"], PruningConfig(), np))
                ),
            },
            "forward_s": forward_s,
            "fit_s": fit_s,
            "held_out": {"raw": summarise(raw), "calibrated": summarise(calibrated)},
        }
        # The monotone map: isotonic regression of surprisal on calibrated entropy (fit text).
        knots_x, knots_y = isotonic(fit_stats["entropy"], fit_stats["surprisal"])
        mapped = np.interp(calibrated["entropy"], knots_x, knots_y)
        gap = entropy_gap(mapped, calibrated["surprisal"])
        row["held_out"]["calibrated_and_mapped"] = {
            "entropy_gap": gap["mean"],
            "entropy_gap_binned": gap["binned"],
            "knots": len(knots_x),
        }
        print(name, row, flush=True)
        if args.pruning_docs:
            docs = long_documents(
                model.tokenizer, articles[PRUNING_ARTICLES], args.pruning_docs, args.pruning_length
            )
            started = time.perf_counter()
            prefilled = prefill_documents(model, docs)
            prefill_s = time.perf_counter() - started

            def run(cfg, temperature=1.0, m=model, p=prefilled):
                # One teacher-forced pass, timed (the first pruned one compiles the program).
                started = time.perf_counter()
                r = perplexity(m, p, cfg, temperature)
                r["seconds"] = time.perf_counter() - started
                print(f"  {cfg.entropy_low:.3f} T={temperature:.4f}: {r}", flush=True)
                return r

            dense = run(PruningConfig())
            on = PruningConfig(enabled=True)
            pruning = {
                "raw": run(on),
                "calibrated": run(on, t),
                "calibrated_paired": run(_shifted(shift), t),
            }
            # Equal kept fraction: the raw signal under a ramp moved until it keeps what the
            # paired calibrated run keeps; then the two differ only in which steps get blocks.
            pruning["raw_equal_kept"] = equal_kept(
                lambda d: run(_shifted(d)),
                pruning["calibrated_paired"]["kept_fraction"],
                pruning["raw"],
                args.secant_steps,
            )
            for r in pruning.values():
                r["ratio"] = (np.array(r["ppl"]) / np.array(dense["ppl"])).tolist()
            row["pruning"] = {
                "dense": dense,
                **pruning,
                "prefill_s": prefill_s,
                "paired_vs_raw_equal_kept": paired_difference(
                    pruning["calibrated_paired"], pruning["raw_equal_kept"]
                ),
                "paired_vs_raw": paired_difference(pruning["calibrated_paired"], pruning["raw"]),
            }
            print(name, row["pruning"], flush=True)
        results[name] = row
        _report(results, args)  # after each model: a run cut short keeps what it measured


def _report(results: dict, args) -> None:
    raw = {"machine": machine_line(), "date": str(datetime.date.today()), "results": results}
    lines = [
        "## Calibration of the entropy signal (held-out text)",
        "",
        f"Measured {raw['date']} on {raw['machine']}. Command: `.venv/bin/python "
        f"benchmarks/calibration.py {shlex.join(sys.argv[1:])}`. A temperature fitted "
        f"(optax L-BFGS, mean NLL) on {args.tokens} scored positions of Lee articles "
        f"{FIT_ARTICLES.start}-{FIT_ARTICLES.stop - 1}, measured on {args.tokens} positions "
        f"of articles {HELD_ARTICLES.start}-{HELD_ARTICLES.stop - 1} (windows of "
        f"{args.window} tokens from an empty cache). ECE: top token, 15 bins. Gap: mean of "
        "entropy - surprisal (nats; negative = over-confident); binned: over 15 equal-count "
        "entropy bins, the entropy's calibration error. `+ map`: a monotone (isotonic) map "
        "from calibrated entropy to expected surprisal, fitted on the fit text.",
        "",
        "| model | T | NLL raw / calibrated | ECE raw / calibrated | gap raw / calibrated | "
        "binned gap raw / calibrated / + map | fit (forward, L-BFGS) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        h = r["held_out"]
        a, b, m = h["raw"], h["calibrated"], h["calibrated_and_mapped"]
        lines.append(
            f"| {name} | {r['temperature']:.4f} | {a['nll']:.4f} / {b['nll']:.4f} | "
            f"{a['ece']:.4f} / {b['ece']:.4f} | {a['entropy_gap']:+.3f} / "
            f"{b['entropy_gap']:+.3f} | {a['entropy_gap_binned']:.3f} / "
            f"{b['entropy_gap_binned']:.3f} / {m['entropy_gap_binned']:.3f} | "
            f"{r['forward_s']:.0f} s, {r['fit_s']:.1f} s ({r['iterations']} steps) |"
        )
    pruned = {n: r for n, r in results.items() if "pruning" in r}
    if pruned:
        lines += [
            "",
            f"Pruning at the default setting (`PruningConfig(enabled=True)`): teacher-forced "
            f"perplexity of the last 512 tokens of {args.pruning_docs} documents of "
            f"{args.pruning_length} tokens (Lee articles {PRUNING_ARTICLES.start}-"
            f"{PRUNING_ARTICLES.stop - 1}, none of them fit text), pruned over dense: mean "
            "(min-max) over documents, and the fraction of the pruned layers' blocks read. "
            "Budgets from the raw entropy; from the calibrated one under the default ramp "
            "(`calibrated, same ramp`); from the calibrated one under the ramp moved by the "
            "shift fitted with the temperature on the fit text so that it keeps the default "
            "budget there (`calibrated, paired ramp`: what `etjax calibrate` writes and the "
            "engine applies); and from the raw entropy with its ramp moved until it keeps what "
            "the paired run keeps (`raw, equal kept`). The last column: the paired run's "
            "log-perplexity minus the equal-kept raw run's, per document, mean +- standard "
            "error (negative: the calibrated signal is better).",
            "",
            "| model | ramp shift (fit-text kept raw / calibrated) | raw | calibrated, same ramp "
            "| calibrated, paired ramp | raw, equal kept (shift) | paired - raw equal kept, "
            "log ppl |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, row in pruned.items():
            p = row["pruning"]

            def cell(r):
                ratio = np.array(r["ratio"])
                return (
                    f"{ratio.mean():.4f} ({ratio.min():.4f}-{ratio.max():.4f}), "
                    f"{r['kept_fraction']:.1%}"
                )

            e, d, fk = p["raw_equal_kept"], p["paired_vs_raw_equal_kept"], row["fit_ramp_kept"]
            lines.append(
                f"| {name} | {row['ramp_shift']:+.3f} nats ({fk['raw']:.1%} / "
                f"{fk['calibrated']:.1%}) | {cell(p['raw'])} | {cell(p['calibrated'])} | "
                f"{cell(p['calibrated_paired'])} | {cell(e)} ({e['shift']:+.3f}) | "
                f"{d['mean']:+.4f} +- {d['se']:.4f} |"
            )
    write_section("calibration", "\n".join(lines), raw)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
