"""The ablation's tables, in Markdown, from the raw record of `run_ablation`.

Two tables: absolute figures (median over repetitions, with min-max for the timed ones) with
transformers `generate` as the outside reference, and the paper's view, every config relative
to the first (the baseline). Below them, whether the full loop is super-additive: its gain
against the sum of the single-level gains, per metric.
"""

from __future__ import annotations

import statistics

from etjax.bench.accelerators import ACCELERATORS, predicted_tokens_per_s

# summary key -> (column title, format, higher is better)
TIMED = {
    "latency_mean_s": ("latency mean s", "{:.1f}", False),
    "latency_p50_s": ("p50 s", "{:.1f}", False),
    "latency_p99_s": ("p99 s", "{:.1f}", False),
    "ttft_mean_s": ("TTFT mean s", "{:.1f}", False),
    "throughput_tok_s": ("throughput tok/s", "{:.1f}", True),
    "dtau_dc_per_gb": ("d tau / d C (nats/GB)", "{:.3f}", True),
}
# Single-level configs whose gains the full loop is compared with.
LEVELS = ("sampling_only", "scheduling_only", "pruning_only")


def medians(raw: dict) -> dict[str, dict[str, float]]:
    """Median over repetitions of every summary figure, per config."""
    return {
        name: {k: statistics.median(s[k] for s in reps) for k in reps[0]}
        for name, reps in raw["summary"].items()
    }


def absolute_table(raw: dict) -> str:
    meds, quality = medians(raw), raw.get("quality", {}).get("rows", {})
    head = [title for title, _, _ in TIMED.values()]
    head += ["ROUGE-L", "BLEU", "ppl ratio", "passkey", "kept", "KV MB / token"]
    head += ["passes / token", "drafted / accepted / verifying passes", "compile s"]
    lines = ["| config | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
    for name, reps in raw["summary"].items():
        cells = []
        for key, (_, fmt, _) in TIMED.items():
            values = [s[key] for s in reps]
            spread = f" ({fmt.format(min(values))}-{fmt.format(max(values))})"
            cells.append(fmt.format(meds[name][key]) + (spread if len(values) > 1 else ""))
        q = quality.get(name)
        cells += (
            [
                f"{q['rouge_l']:.3f}",
                f"{q['bleu']:.1f}",
                f"{q['ppl_ratio']:.4f}",
                f"{q['passkey_accuracy']:.0%}",
            ]
            if q
            else ["-"] * 4
        )
        cells += [
            f"{meds[name]['kept_fraction']:.0%}",
            f"{meds[name]['kv_mb_per_token']:.1f}",
            f"{meds[name].get('passes_per_token', 1.0):.2f}",
            draft_counts(meds[name]),
            f"{max(s['compile_s'] for s in reps):.1f}",
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    ref = raw.get("reference")
    if ref:
        import numpy as np

        latency = np.array([r["end_to_end_latency"] for r in ref["requests"]])
        cells = [
            f"{latency.mean():.1f}",
            f"{np.percentile(latency, 50):.1f}",
            f"{np.percentile(latency, 99):.1f}",
            "-",
            f"{ref['throughput_tok_s']:.1f}",
            "-",
            f"{ref['rouge_l_vs_baseline']:.3f}" if "rouge_l_vs_baseline" in ref else "-",
            f"{ref['bleu_vs_baseline']:.1f}" if "bleu_vs_baseline" in ref else "-",
            "-",
            "-",
            "100%",
            "-",
            "1.00",
            "-",
            "-",
        ]
        lines.append(
            f"| transformers generate (greedy, batch {ref['batch_size']}) | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


def draft_counts(summary: dict[str, float]) -> str:
    """What drafting did over a run: "drafted / accepted / verifying passes" ("-" for a
    record from before the counts)."""
    if "accepted_tokens" not in summary:
        return "-"
    return (
        f"{summary['drafted_tokens']:.0f} / {summary['accepted_tokens']:.0f} / "
        f"{summary['verify_steps']:.0f}"
    )


def relative_table(raw: dict) -> str:
    meds, quality = medians(raw), raw.get("quality", {}).get("rows", {})
    base = next(iter(raw["summary"]))
    head = [TIMED[k][0] for k in TIMED] + ["ROUGE-L", "1 / ppl ratio", "passkey"]
    lines = [
        f"| relative to {base} | " + " | ".join(head) + " |",
        "|---" * (len(head) + 1) + "|",
    ]
    for name in raw["summary"]:
        cells = [f"{meds[name][k] / meds[base][k]:.2f}" for k in TIMED]
        q, qb = quality.get(name), quality.get(base)
        if q and qb:
            passkey = (
                q["passkey_accuracy"] / qb["passkey_accuracy"] if qb["passkey_accuracy"] else 1.0
            )
            cells += [f"{q['rouge_l']:.3f}", f"{1 / q['ppl_ratio']:.3f}", f"{passkey:.2f}"]
        else:
            cells += ["-"] * 3
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def gain(meds: dict, name: str, base: str, key: str) -> float:
    """How many times better `name` is than `base` on `key` (> 1 is better either way)."""
    ratio = meds[name][key] / meds[base][key]
    return ratio if TIMED[key][2] else 1.0 / ratio


def additivity(raw: dict) -> str:
    """One line per metric: the full loop's gain against the sum and product of the levels'."""
    meds = medians(raw)
    base = next(iter(raw["summary"]))
    if "full" not in meds or not all(level in meds for level in LEVELS):
        return "Super-additivity needs baseline, the three single-level configs and full."
    lines = []
    for key in ("latency_mean_s", "throughput_tok_s", "dtau_dc_per_gb"):
        gains = [gain(meds, level, base, key) for level in LEVELS]
        full = gain(meds, "full", base, key)
        additive = 1.0 + sum(g - 1.0 for g in gains)
        product = 1.0
        for g in gains:
            product *= g
        verdict = "super-additive" if full > additive else "not super-additive"
        lines.append(
            f"- {TIMED[key][0]}: full loop {full:.2f}x better; levels "
            f"{', '.join(f'{g:.2f}x' for g in gains)} add to {additive:.2f}x and multiply to "
            f"{product:.2f}x: **{verdict}**."
        )
    return "\n".join(lines)


def cost_table(raw: dict) -> str:
    """Per generated token: bytes and FLOPs as measured, and what a roofline model of named
    accelerators makes of them (etjax/bench/accelerators.py), beside the weights' format (the
    model's, "q4_1+q8_0" or "float32"; "-" in records from before it). Empty for records
    without them."""
    meds = medians(raw)
    if not all("weight_mb_per_token" in m for m in meds.values()):
        return ""
    chips = [f"{chip.name} tok/s (model)" for chip in ACCELERATORS]
    head = ["weights", "weights MB / token", "KV MB / token", "GFLOP / token", "passes / token"]
    head += chips
    lines = ["| config | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
    for name, m in meds.items():
        nbytes = (m["weight_mb_per_token"] + m["kv_mb_per_token"]) * 1e6
        flops = m["gflop_per_token"] * 1e9
        cells = [
            raw.get("weights", "-"),
            f"{m['weight_mb_per_token']:.1f}",
            f"{m['kv_mb_per_token']:.1f}",
            f"{m['gflop_per_token']:.2f}",
            f"{m.get('passes_per_token', 1.0):.2f}",
        ]
        cells += [f"{predicted_tokens_per_s(chip, nbytes, flops):,.0f}" for chip in ACCELERATORS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return (
        "\n".join(lines)
        + "\n\nThe accelerator columns are a roofline model, not a measurement: tokens/s = "
        "1 / max(bytes / bandwidth, FLOPs / peak) at published peaks (TPU v5e 819 GB/s, "
        "197 TFLOP/s; TPU v6e 1,640 GB/s, 918 TFLOP/s; H100 SXM 3,350 GB/s, 989 TFLOP/s), "
        "with this run's bytes in its dtype and its batching."
    )


def markdown(raw: dict) -> str:
    """The tables and the additivity lines."""
    parts = [absolute_table(raw), relative_table(raw), additivity(raw), cost_table(raw)]
    return "\n\n".join(p for p in parts if p)
