"""Calibration of the entropy signal on held-out text, before and after a fitted temperature.

For each model: the temperature is fitted (etjax/calibration/fit.py, optax L-BFGS on the
mean NLL) to the first `--tokens` scored positions of some Lee articles, and measured on
`--tokens` positions of other articles it never saw (windows of `--window` tokens, each from
an empty cache): next-token NLL, the expected calibration error of the top token (15 bins),
the mean gap between the entropy and the realised surprisal, and that gap over 15 equal-count
entropy bins (the entropy's own calibration error). A monotone map from entropy to expected
surprisal (isotonic regression on the fit text, after the temperature) is measured the same
way, to see whether it earns a place beside the temperature. Then pruning at the default
setting: teacher-forced perplexity of long documents' last tokens through the decode path
(etjax/bench/perplexity.py), dense, with budgets from the raw entropy and from the calibrated
one. Writes the "calibration" section of docs/PERF.md.

    .venv/bin/python benchmarks/calibration.py [--models smollm2-135m-instruct,gemma3-270m]
        [--tokens 2048] [--pruning-docs 2] [--pruning-length 2048]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2-135m-instruct,gemma3-270m")
    parser.add_argument("--tokens", type=int, default=2048, help="scored positions per set")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--pruning-docs", type=int, default=2, help="0 skips pruning")
    parser.add_argument("--pruning-length", type=int, default=2048)
    parser.add_argument("--bisection-steps", type=int, default=5)
    args = parser.parse_args()

    import etjax
    from etjax.bench.corpus import lee_articles
    from etjax.bench.perplexity import long_documents, perplexity, prefill_documents
    from etjax.calibration.fit import fit_temperature, teacher_forced, text_statistics
    from etjax.calibration.metrics import entropy_gap, summarise, token_statistics
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
        del logits
        raw, calibrated = text_statistics(model, held_texts, [1.0, t], args.window, args.tokens)
        row = {
            "temperature": t,
            "iterations": fit.iterations,
            "fit_tokens": int(targets.size),
            "fit_nll_before": fit.nll_before,
            "fit_nll_after": fit.nll_after,
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
            docs = long_documents(model.tokenizer, articles, args.pruning_docs, args.pruning_length)
            prefilled = prefill_documents(model, docs)
            dense = perplexity(model, prefilled, PruningConfig())
            pruning = {}
            for label, temperature in (("raw", 1.0), ("calibrated", t)):
                r = perplexity(model, prefilled, PruningConfig(enabled=True), temperature)
                r["ratio"] = (np.array(r["ppl"]) / np.array(dense["ppl"])).tolist()
                pruning[label] = r
            # Equal kept fraction: the raw signal under a ramp shifted down by delta nats
            # (bisection), so it keeps what the calibrated one keeps; then the two differ only
            # in which steps get the blocks.
            target = pruning["calibrated"]["kept_fraction"]
            low, high, best = -4.0, 0.0, None
            for _ in range(args.bisection_steps):
                delta = (low + high) / 2
                shifted = perplexity(model, prefilled, _shifted(delta))
                shifted["shift"] = delta
                if best is None or abs(shifted["kept_fraction"] - target) < abs(
                    best["kept_fraction"] - target
                ):
                    best = shifted
                if shifted["kept_fraction"] > target:
                    low = delta
                else:
                    high = delta
            best["ratio"] = (np.array(best["ppl"]) / np.array(dense["ppl"])).tolist()
            pruning["raw_equal_kept"] = best
            row["pruning"] = {"dense": dense, **pruning}
            print(name, row["pruning"], flush=True)
        results[name] = row
    _report(results, args)


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
    pruned = {n: r["pruning"] for n, r in results.items() if "pruning" in r}
    if pruned:
        lines += [
            "",
            f"Pruning at the default setting (`PruningConfig(enabled=True)`), budgets from the "
            f"raw or the calibrated entropy: teacher-forced perplexity of the last 512 tokens "
            f"of {args.pruning_docs} documents of {args.pruning_length} tokens, pruned over "
            "dense (mean over documents), and the fraction of the pruned layers' blocks read. "
            "The calibrated signal is higher (T > 1), so it keeps more; `raw, equal kept` moves "
            "the raw signal's ramp down by the shift given (bisection) until it keeps as much, "
            "the comparison at equal kept fraction.",
            "",
            "| model | raw: ppl ratio (kept) | calibrated: ppl ratio (kept) | "
            "raw, equal kept: ppl ratio (kept, shift) |",
            "|---|---|---|---|",
        ]
        for name, p in pruned.items():
            r, c, e = p["raw"], p["calibrated"], p["raw_equal_kept"]
            lines.append(
                f"| {name} | {np.mean(r['ratio']):.4f} ({r['kept_fraction']:.1%}) | "
                f"{np.mean(c['ratio']):.4f} ({c['kept_fraction']:.1%}) | "
                f"{np.mean(e['ratio']):.4f} ({e['kept_fraction']:.1%}, {e['shift']:+.2f} nats) |"
            )
    write_section("calibration", "\n".join(lines), raw)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
