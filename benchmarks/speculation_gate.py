"""Speculation as a latency user meets it on this machine: batch 1, greedy, `decode()` with and
without `speculation=True`, on copy-heavy and free-form prompts (SmolLM2-135M-Instruct).

- copy-heavy: an edit whose answer is mostly the prompt's own text (a JSON object
  reformatted, a list copied, a paragraph and an email corrected); prompt lookup should
  draft long runs and have them accepted; target: latency with speculation at most 0.6x of
  without;
- passage: issue 65's first copy-heavy prompts, a 96-token passage of a Lee corpus article
  then "Repeat the passage above word for word." (SmolLM2 leaves some passages after a few
  dozen tokens), against the same target;
- free-form: an instruction with little to copy; target: at least 0.98x the speed without
  (the cost gate, on the step costs measured here, keeps speculation from costing).

How copy-heavy each prompt is, is measured, not assumed: the fraction of the plain greedy
output's tokens that lie in runs of at least `COPY_RUN` tokens found verbatim in the prompt
(`copied_fraction`).

Each prompt runs alone (one `decode()` call: batch 1, `max_new_tokens` new tokens, end of
sequence ignored so every call does the same work), once per setting as a warm-up
(compilation, and the gate's step costs measured: etjax/drafting/costs.py), then
`--repeats` interleaved repetitions (the settings' order alternating per repetition).
Reports, per prompt and per kind, the median latency and its spread with and without, the
median of the paired ratios, and beside them what speculation did (tokens drafted and
accepted, verifying passes, model passes, from `Result`); checks that the outputs are
identical. Writes the "speculation_gate" section of docs/PERF.md.

    .venv/bin/python benchmarks/speculation_gate.py [--prompts 4] [--repeats 5]
    .venv/bin/python benchmarks/speculation_gate.py --prompts 1 --repeats 1 --no-write  # smoke
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.perf_report import machine_line, write_section
from benchmarks.speculation_bound import fewest_burst_steps
from etjax.bench.perf_doc import cpu_name
from etjax.drafting import SpeculationConfig
from etjax.drafting.costs import measured_tables
from etjax.drafting.rule import draft_caps, step_cost_ratio
from etjax.runtime.options import DRAFT_COUNTS, RuntimeOptions

SETTINGS = ("off", "on")
KINDS = ("copy-heavy", "passage", "free-form")
TARGETS = {
    "copy-heavy": "<= 0.60x",
    "passage": "<= 0.60x",
    "free-form": "<= 1.02x (>= 0.98x the speed)",
}
# Edits whose answer SmolLM2 copies from the prompt (88-100% of its greedy output's tokens,
# `copied_fraction`, when written).
COPY_HEAVY = (
    "Reformat this JSON with one key per line and two spaces of indentation:\n"
    '{"name": "Ada Lovelace", "born": 1815, "died": 1852, "country": "United Kingdom", '
    '"known_for": ["Analytical Engine", "first computer program", "Notes on the Menabrea '
    'paper"], "father": "Lord Byron"}',
    "Correct the grammar in this email and return the whole email:\n\nHi Sarah,\n\nThank "
    "you for sending the report yesterday. I has read it carefully and I think the numbers "
    "for the third quarter looks good. Could you please add a short summary at the beginning "
    "and send it to the team before Friday? Let me know if you needs any help with the "
    "charts.\n\nBest regards,\nDavid",
    "Copy this shopping list exactly, one item per line:\n- 2 cartons of milk\n- a loaf of "
    "whole wheat bread\n- 12 eggs\n- 3 ripe bananas\n- a bag of brown rice\n- olive oil\n"
    "- 4 tomatoes\n- a block of cheddar cheese\n- ground coffee\n- dish soap",
    "Correct the spelling mistakes in this paragraph and return the whole corrected "
    "paragraph:\n\nThe river runs through the center of the old town, past the market "
    "square and the church with the tall clock towre. Every morning the fishermen bring "
    "their boats to the stone pier and sell their catch to the restaurants along the water. "
    "In the evening the streets fill with families walking by the river and children "
    "playing near the fountain.",
)
# Held-out articles of the Lee corpus for the passages (none of them is in the mixed
# workload's first requests), and how many tokens of each.
ARTICLES = (17, 58, 121, 203)
PASSAGE_TOKENS = 96
FREE_FORM = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain to a child why the sky is blue.",
    "Give three tips for someone learning to cook, with a reason for each.",
    "Describe a busy market early in the morning.",
)
COPY_RUN = 4  # the shortest run of output tokens counted as copied from the prompt


def prompts(tokenizer, articles: list[str], count: int) -> dict[str, list[str]]:
    """`count` prompts of each kind (`KINDS`)."""
    passages = []
    for index in ARTICLES[:count]:
        passage = tokenizer.decode(tokenizer.encode(articles[index])[:PASSAGE_TOKENS])
        passages.append(f"{passage.strip()}\n\nRepeat the passage above word for word.")
    return {
        "copy-heavy": list(COPY_HEAVY[:count]),
        "passage": passages,
        "free-form": list(FREE_FORM[:count]),
    }


def copied_fraction(prompt: list[int], output: list[int], run: int = COPY_RUN) -> float:
    """The fraction of `output`'s tokens that lie in runs of at least `run` tokens found
    verbatim in `prompt`: from the start of the output, the longest run found in the prompt
    is taken where it is that long, else one token is left uncopied."""
    if not output:
        return 0.0
    copied, i = 0, 0
    while i < len(output):
        longest = max((_common_run(prompt, j, output, i) for j in range(len(prompt))), default=0)
        if longest >= run:
            copied += longest
            i += longest
        else:
            i += 1
    return copied / len(output)


def _common_run(a: list[int], i: int, b: list[int], j: int) -> int:
    # How many tokens a[i:] and b[j:] share from their starts.
    n = 0
    while i + n < len(a) and j + n < len(b) and a[i + n] == b[j + n]:
        n += 1
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4, help="prompts of each kind (<= 4)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--no-write", action="store_true", help="print, do not write PERF.md")
    parser.add_argument(
        "--weights", default="auto", help="load_model's weights option (default: auto)"
    )
    args = parser.parse_args()
    import etjax
    from etjax.bench.corpus import lee_articles

    load_start = os.getloadavg()[0]
    model = etjax.load_model(weights=args.weights)
    kinds = prompts(model.tokenizer, lee_articles(), min(args.prompts, len(ARTICLES)))
    cases = [(kind, i, text) for kind, texts in kinds.items() for i, text in enumerate(texts)]

    def run(text: str, setting: str):
        started, cpu = time.perf_counter(), time.process_time()
        (result,) = etjax.decode(
            text,
            model=model,
            chat=True,
            max_new_tokens=args.max_new_tokens,
            ignore_eos=True,
            max_batch_size=1,
            speculation=setting == "on",
        )
        return time.perf_counter() - started, time.process_time() - cpu, result

    first = {}
    for kind, i, text in cases:  # warm-up: compiles, and the gate's costs are measured
        for setting in SETTINGS:
            first[(kind, i, setting)] = run(text, setting)[2]
    seconds = {(kind, i, s): [] for kind, i, _ in cases for s in SETTINGS}
    cpu_seconds = {key: [] for key in seconds}
    counts = {key: [] for key in seconds}
    identical = {}
    for rep in range(args.repeats):
        order = SETTINGS if rep % 2 == 0 else SETTINGS[::-1]
        for kind, i, text in cases:
            for setting in order:
                elapsed, cpu, result = run(text, setting)
                seconds[(kind, i, setting)].append(elapsed)
                cpu_seconds[(kind, i, setting)].append(cpu)
                # Every repetition's: the gate's inputs carry over from call to call (its
                # measured costs, per process), so one prompt can draft in one repetition
                # and not in the next.
                counts[(kind, i, setting)].append(
                    {name: getattr(result, name) for name in DRAFT_COUNTS}
                )
                same = result.token_ids == first[(kind, i, "off")].token_ids
                identical[(kind, i)] = identical.get((kind, i), True) and same
            print(kind, i, {s: f"{seconds[(kind, i, s)][-1]:.2f} s" for s in SETTINGS}, flush=True)
    copied = {
        (kind, i): copied_fraction(result.prompt_token_ids, result.token_ids)
        for (kind, i, setting), result in first.items()
        if setting == "off"
    }
    raw = _raw(args, cases, (seconds, cpu_seconds), counts, identical, copied, load_start)
    for row in raw["rows"]:
        off = first[(row["kind"], row["prompt"], "off")]
        row["bound"] = best_ratio(off.prompt_token_ids, off.token_ids, row["off_s"])
    raw["weights"] = model.weights_format  # what load_model's `weights` held
    markdown = _markdown(raw)
    print(markdown)
    if not args.no_write:
        write_section("speculation_gate", markdown, raw)


def best_ratio(prompt: list[int], output: list[int], off_seconds: list[float]) -> float | None:
    """The least on / off latency any drafting rule could reach on this prompt here
    (benchmarks/speculation_bound.py): the plain call's time with its decode steps replaced
    by the fewest burst steps of cost that commit the same output, priced by the gate's
    measured costs at batch 1 (None before both a burst and a verifying step are measured)."""
    cfg = SpeculationConfig(enabled=True)
    # The table of the speculating engines: the one with a verifying step at batch 1.
    tables = [t for t in measured_tables().values() if t.verify_seconds(1, 1, max) is not None]
    burst = tables[0].burst_seconds(1) if tables else None
    if burst is None:
        return None

    def ratio(drafted: int, checked: int) -> float:
        return step_cost_ratio(1, drafted, cfg, tables[0], checked)[0]

    def steps(counts) -> float:
        burst_steps = RuntimeOptions().steps_per_sync  # decode()'s, as the calls ran
        return fewest_burst_steps(
            prompt, output, ratio, burst_steps, counts, cfg.ngram_max, cfg.ngram_min
        )

    off = statistics.median(off_seconds)
    return (off - burst * (steps(()) - steps(draft_caps(cfg.max_draft)))) / off


def _raw(args, cases, seconds, counts, identical, copied, load_start) -> dict:
    seconds, cpu_seconds = seconds
    rows = []
    for kind, i, text in cases:
        off, on = seconds[(kind, i, "off")], seconds[(kind, i, "on")]
        cpu_off, cpu_on = cpu_seconds[(kind, i, "off")], cpu_seconds[(kind, i, "on")]
        rows.append(
            {
                "kind": kind,
                "prompt": i,
                "text": text,
                "off_s": off,
                "on_s": on,
                # Paired: each repetition's two runs were next to each other.
                "ratio": statistics.median(b / a for a, b in zip(off, on, strict=True)),
                # The process's CPU time (its threads summed): what other processes' load
                # moves less than the wall clock.
                "cpu_off_s": cpu_off,
                "cpu_on_s": cpu_on,
                "cpu_ratio": statistics.median(b / a for a, b in zip(cpu_off, cpu_on, strict=True)),
                "counts": counts[(kind, i, "on")],  # one per repetition
                "identical": identical[(kind, i)],
                "copied": copied[(kind, i)],
            }
        )
    costs = {key: table.medians() for key, table in measured_tables().items()}
    return {
        "machine": machine_line(),
        "date": str(datetime.date.today()),
        "command": shlex.join(sys.argv[1:]),
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "copy_run": COPY_RUN,
        "load": [load_start, os.getloadavg()[0]],  # 1-minute load averages, start and end
        "rows": rows,
        "step_costs": costs,  # the gate's measured inputs (seconds), per model shape
    }


def _markdown(raw: dict) -> str:
    load = raw["load"]
    lines = [
        "## Speculation at batch 1 on this machine: copy-heavy and free-form text "
        f"(SmolLM2-135M-Instruct, weights {raw.get('weights', 'float32')}, greedy, "
        f"{cpu_name(raw['machine'])})",
        "",
        f"Measured {raw['date']} on {raw['machine']}; the load average (1 min) was "
        f"{load[0]:.1f} at the start and {load[1]:.1f} at the end"
        + (" (other processes loaded the machine)" if max(load) > 2.5 else "")
        + ". Command: `.venv/bin/python "
        f"benchmarks/speculation_gate.py {raw['command']}`. Each prompt alone through "
        f"`decode(..., chat=True, max_new_tokens={raw['max_new_tokens']}, ignore_eos=True)` "
        "with `speculation` off and on; a warm-up call of each, then "
        f"{raw['repeats']} interleaved repetitions (the settings' order alternating), median "
        "(min-max) seconds and the median of the paired on/off ratios. Copy-heavy: an edit "
        "whose answer is mostly the prompt's text (a JSON object reformatted, an email's "
        "grammar and a paragraph's spelling corrected, a list copied); passage: issue 65's "
        'first prompts, a 96-token passage of a Lee corpus article, then "Repeat the passage '
        'above word for word."; free-form: an instruction with little to copy. Copied: the '
        "fraction of the plain greedy output's tokens in runs of at least "
        f"{raw['copy_run']} tokens found verbatim in the prompt. Counts: what speculation did "
        "(`Result` fields), the median (min-max) over the repetitions: the gate's measured "
        "costs carry over from call to call, so a prompt may draft in one and not the next. "
        "on / off CPU: the paired ratio of the process's CPU time (threads summed), which "
        "other processes' load moves less than the wall clock. Best rule: the least on / off "
        "any drafting rule could reach with this lookup and these step costs "
        "(benchmarks/speculation_bound.py: the plain output's rounds chosen by an oracle "
        "that knows where each draft fails, priced by the measured costs below; the plain "
        "call's other time, prefill and host, unchanged).",
        "",
        "| kind | prompt | copied | off s | on s | on / off | on / off CPU | best rule | "
        "drafted | accepted | verifying passes | model passes | identical |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in raw["rows"]:
        c = _count_spreads(row["counts"])
        lines.append(
            f"| {row['kind']} | {row['prompt']} | {row['copied']:.0%} | {_spread(row['off_s'])} | "
            f"{_spread(row['on_s'])} | {row['ratio']:.2f}x | {row['cpu_ratio']:.2f}x | "
            f"{_times(row.get('bound'))} | {c['drafted_tokens']} | "
            f"{c['accepted_tokens']} | {c['verify_steps']} | {c['model_passes']} | "
            f"{'yes' if row['identical'] else 'NO'} |"
        )
    lines += [
        "",
        "| kind | on / off (median of prompts) | CPU | best rule | target | identical |",
        "|---|---|---|---|---|---|",
    ]
    for kind, target in TARGETS.items():
        rows = [r for r in raw["rows"] if r["kind"] == kind]
        if rows:
            ratio = statistics.median(r["ratio"] for r in rows)
            # Runs written before CPU time was recorded have none.
            cpu = statistics.median(r.get("cpu_ratio", float("nan")) for r in rows)
            same = all(r["identical"] for r in rows)
            bounds = [r["bound"] for r in rows if r.get("bound") is not None]
            bound = statistics.median(bounds) if len(bounds) == len(rows) else None
            lines.append(
                f"| {kind} | {ratio:.2f}x | {cpu:.2f}x | {_times(bound)} | {target} | "
                f"{'yes' if same else 'NO'} |"
            )
    for medians in raw["step_costs"].values():
        if medians:
            shown = ", ".join(f"{name} {s * 1e3:.1f} ms" for name, s in medians.items())
            lines += ["", f"The gate's measured step costs (median): {shown}."]
    return "\n".join(lines)


def _count_spreads(counts: list[dict[str, int]]) -> dict[str, str]:
    # Each count's median (min-max) over the repetitions; one value where they agree.
    spreads = {}
    for name in DRAFT_COUNTS:
        values = [c[name] for c in counts]
        low, high = min(values), max(values)
        middle = statistics.median(values)
        shown = f"{middle:g}"
        spreads[name] = shown if low == high else f"{shown} ({low}-{high})"
    return spreads


def _times(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def _spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


if __name__ == "__main__":
    main()
