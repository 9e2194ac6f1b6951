"""Structured output on SmolLM2: a JSON-schema extraction workload of 32 news records, and what
`logprobs=5` costs a batch-32 decode step, side by side in one run (docs/PERF.md section
`structured_output`).

Extraction: each record asks for one JSON object (`SCHEMA`: a category enum, a country, a
person, a year and a short summary) about the opening of a Lee corpus article. Six variants
of the same 32 requests run interleaved, greedy, all 32 in one batch, `--repeats` times after
one warm-up pass that compiles their programs:
  - `unconstrained`: the same prompts and `max_new_tokens`, no schema (the throughput baseline);
  - `schema, forced as steps`: the schema with `forced_tokens` off, each forced token a step;
  - `schema, forced drafted (default gate)`: the default: a run of forced tokens drafted and
    verified in one pass (etjax/drafting/forced.py) in rounds where the cost gate says a
    verifying step pays over a burst;
  - `schema, forced drafted every round`: the gate of a device whose passes are bound by
    reading the weights (`pass_fixed_tokens=1000`, read as constants rather than measured
    costs: `measured_costs=False`), so every forced run is drafted;
  - `schema, forced and lookup drafted every round`: the same device with speculation on,
    so where the next token is free a row drafts by prompt lookup (values copied from the
    article), cut to the schema; its passes hold up to 256 tokens (`draft_budget`; the
    default 16 is this CPU's, where a batch of 32 rows drafts no lookup at all), as a pass
    bound by reading the weights would (an H100 reads SmolLM2's float32 weights in the time
    it computes several hundred tokens);
  - `unconstrained, the schema's lengths`: each record unconstrained, generating exactly as
    many tokens as its schema answer has (`ignore_eos`): equal work, so its ratio to the
    schema variants is the constrained step's cost, not the answers' lengths.
Reported per variant: outputs that parse and validate (`jsonschema`) and ended by themselves,
generated tokens per second (median and spread over the repeats; prefill included, the same
records for all), the paired median throughput ratio to `unconstrained` and to
`unconstrained, the schema's lengths` (equal work), model passes per
generated token (a pass that verifies drafts counts once), and what explains the throughput:
the engine's batch passes (a burst counts its steps), the tokens each advanced (constrained
outputs are shorter, so the batch drains sooner) and the wall time each took (the run's, so
the prompts' prefill, the same for every variant, weighs more on fewer passes), and the time
per step of the bursts over 17-32 rows (the step at equal rows, which the mask, the host's
callback and the sampler over a masked distribution add to). The schema
variants must give the same tokens (greedy): the run checks it, and replays their outputs
through the schema's matcher for the floor of passes per token (every forced run drafted).

logprobs: two engines of 32 decoding rows each (48-token prompts, `ignore_eos`), one with
`logprobs=5`, stepped in turn (`steps_per_sync` steps a round) after two warm-up rounds; the
time per decode step, median and spread, and the paired median ratio.

Other processes' CPU time during the run (the machine's busy time in /proc/stat less this
process's) is reported, and the section says "under load" when it was more than a tenth of a
core (the machine is shared).

    .venv/bin/python benchmarks/structured_output.py [--repeats 3] [--steps 12] [--write]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import jsonschema
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import etjax
from etjax.bench.corpus import lee_articles
from etjax.bench.perf_doc import machine_line, replace_section
from etjax.constraints import matcher
from etjax.drafting import SpeculationConfig
from etjax.engine.sequence import Status
from etjax.engine_build import RequestSettings, RuntimeOptions, build_engine, workload_pages

RECORDS = 32
MAX_NEW_TOKENS = 96
EQUAL = "unconstrained, the schema's lengths"
SCHEMA = {
    "type": "object",
    "properties": {
        "category": {"enum": ["politics", "sport", "business", "crime", "disaster", "other"]},
        "country": {"type": "string", "maxLength": 24},
        "person": {"type": "string", "maxLength": 32},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
        "summary": {"type": "string", "maxLength": 100},
    },
    "required": ["category", "country", "person", "year", "summary"],
    "additionalProperties": False,
}


def _prompts(model) -> list[list[int]]:
    prompts = []
    for article in lee_articles()[:RECORDS]:
        text = " ".join(article.split()[:60])
        ask = (
            "Extract from this news text a JSON object with the keys category, country, "
            f"person, year and summary.\n\n{text}"
        )
        messages = [
            {"role": "system", "content": "Answer in JSON."},
            {"role": "user", "content": ask},
        ]
        prompts.append(model.tokenizer.encode_chat(messages, add_generation_prompt=True))
    return prompts


def _valid(out) -> bool:
    if out.finish_reason != "eos":
        return False
    try:
        jsonschema.validate(json.loads(out.text), SCHEMA)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def _fewest_passes(model, outs, max_draft: int) -> int:
    # The passes the outputs need when every forced run is drafted at its start (up to
    # 1 + max_draft tokens a pass) and every other token is a pass: the floor of passes per
    # token for these outputs. Replayed through a fresh matcher of the schema.
    passes, vocab = 0, model.config.vocab_size
    for out in outs:
        gid = matcher.register("json_schema", json.dumps(SCHEMA), model.tokenizer, vocab)
        tokens, i = out.token_ids, 0
        while i < len(tokens):
            step = max(min(len(matcher.forced_tokens(gid)), 1 + max_draft, len(tokens) - i), 1)
            for k in range(i, i + step):
                row = (np.array([gid]), np.array([tokens[k]]), np.array([k]), np.ones(1, bool))
                matcher.advance(*row, matcher.mask_words(vocab))
            passes, i = passes + 1, i + step
        matcher.release(gid)
    return passes


def _others_cpu_seconds() -> float:
    # CPU seconds used so far by everything but this process: the machine's busy time
    # (/proc/stat: user, nice, system, irq, softirq, steal) less this process's own. Summing
    # /proc/PID/stat instead missed processes that ended during the run (another session's
    # tests): it read 0.07 cores under a load average of 4.
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, _, _, irq, softirq, steal = fields
    busy = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    own = os.times()
    return busy - (own.user + own.system + own.children_user + own.children_system)


def _timed_bursts(engine, steps: list[float]) -> None:
    # Append the time per step of each of the engine's full-batch bursts (row bucket 32: 17
    # to 32 rows) to `steps`: the cost of a pass at equal rows, whatever the answers' lengths.
    decode = engine.backend.decode

    def timed(rows, *args, **kwargs):
        started = time.perf_counter()
        out = decode(rows, *args, **kwargs)
        if len(rows) > RECORDS // 2:
            steps.append((time.perf_counter() - started) / engine.options.steps_per_sync)
        return out

    engine.backend.decode = timed


def extraction(model, repeats: int) -> tuple[list[str], dict]:
    prompts = _prompts(model)
    schema = json.dumps(SCHEMA)
    # A pass that costs 1000 token computes before its tokens: the cost gate of a device
    # whose passes are bound by reading the weights, which drafts every forced run.
    variants = {
        "unconstrained": ({}, SpeculationConfig()),
        "schema, forced as steps": (
            {"json_schema": schema},
            SpeculationConfig(forced_tokens=False),
        ),
        "schema, forced drafted (default gate)": ({"json_schema": schema}, SpeculationConfig()),
        "schema, forced drafted every round": (
            {"json_schema": schema},
            SpeculationConfig(pass_fixed_tokens=1000.0, measured_costs=False),
        ),
        "schema, forced and lookup drafted every round": (
            {"json_schema": schema},
            SpeculationConfig(
                enabled=True, pass_fixed_tokens=1000.0, draft_budget=256, measured_costs=False
            ),
        ),
        # Its lengths are the schema answers' (known after the warm-up pass): runs last.
        EQUAL: ({"ignore_eos": True}, SpeculationConfig()),
    }
    stats: dict[str, dict[str, list[float]]] = {
        name: {"tps": [], "valid": [], "ppt": [], "rows": [], "ms": [], "burst": []}
        for name in variants
    }
    tokens_of: dict[str, list[list[int]]] = {}
    outs_of: dict[str, list] = {}
    for repeat in range(repeats + 1):  # the first pass compiles and warms up
        for name, (fields, spec) in variants.items():
            options = RuntimeOptions(max_batch_size=RECORDS, speculation=spec)
            lengths = [MAX_NEW_TOKENS] * RECORDS
            if name == EQUAL:
                lengths = [len(t) for t in tokens_of["schema, forced as steps"]]
            settings = [RequestSettings(max_new_tokens=n, **fields) for n in lengths]
            pages = workload_pages(prompts, settings, options)
            engine = build_engine(model.weights, model.config, model.tokenizer, options, pages)
            bursts: list[float] = []
            _timed_bursts(engine, bursts)
            started = time.perf_counter()
            outs = engine.generate(prompts, settings)
            elapsed = time.perf_counter() - started
            tokens_of[name], outs_of[name] = [o.token_ids for o in outs], outs
            if repeat == 0:
                continue
            generated = sum(len(o.token_ids) for o in outs)
            passes = sum(o.metrics["passes_per_token"] * len(o.token_ids) for o in outs)
            stats[name]["tps"].append(generated / elapsed)
            stats[name]["valid"].append(sum(_valid(o) for o in outs) / RECORDS)
            stats[name]["ppt"].append(passes / generated)
            # Batch passes (bursts count their steps): rows advanced and wall time per pass.
            stats[name]["rows"].append(generated / engine.model_passes)
            stats[name]["ms"].append(1e3 * elapsed / engine.model_passes)
            # A variant that verifies every round may run no full-batch burst at all.
            stats[name]["burst"].append(1e3 * float(np.median(bursts)) if bursts else np.nan)
    schema_runs = [tokens_of[name] for name in variants if name.startswith("schema")]
    same = all(run == schema_runs[0] for run in schema_runs)
    equal = [len(t) for t in tokens_of[EQUAL]] == [len(t) for t in schema_runs[0]]
    schema_outs = tokens_of["schema, forced as steps"]
    generated = sum(len(t) for t in schema_outs)
    fewest = _fewest_passes(
        model, outs_of["schema, forced as steps"], SpeculationConfig().max_draft
    )
    base = np.asarray(stats["unconstrained"]["tps"])
    base_equal = np.asarray(stats[EQUAL]["tps"])
    lines = [
        f"| variant ({RECORDS} records, greedy, max_new_tokens={MAX_NEW_TOKENS}) | valid "
        "(schema, ended by eos) | tokens/s (median) | spread | vs unconstrained "
        "(paired median) | vs unconstrained at the schema's lengths | passes per token "
        "| batch passes: tokens each | ms each "
        f"| burst step of {RECORDS // 2 + 1}-{RECORDS} rows, ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in stats.items():
        tps = np.asarray(s["tps"])
        schema_row = name.startswith("schema")
        valid = f"{100 * np.median(s['valid']):.0f}%" if schema_row else "n/a"
        lines.append(
            f"| {name} | {valid} | {np.median(tps):.1f} | {tps.min():.1f}-{tps.max():.1f} "
            f"| {np.median(tps / base):.3f}x | {np.median(tps / base_equal):.3f}x "
            f"| {np.median(s['ppt']):.3f} "
            f"| {np.median(s['rows']):.1f} | {np.median(s['ms']):.0f} "
            f"| {_ms(s['burst'])} |"
        )
    lines.append("")
    lines.append(
        f"The schema variants gave {'the same' if same else 'DIFFERENT'} tokens for "
        f"every record; `{EQUAL}` generated {'as many' if equal else 'A DIFFERENT NUMBER OF'} "
        f"tokens per record as they did. Generated tokens per run: "
        + ", ".join(f"{n} {sum(len(t) for t in tokens_of[n])}" for n in variants)
        + f". The floor for the schema outputs, every forced run drafted at its start and "
        f"every other token a pass: {fewest / generated:.3f} passes per token "
        f"({generated - fewest} of {generated} tokens ride behind a run's first)."
    )
    return lines, {"same_tokens": same, "equal_lengths": equal, **stats}


def _ms(values: list[float]) -> str:
    # The median of the repeats' burst steps, or "none" where no repeat ran one.
    finite = [v for v in values if np.isfinite(v)]
    return f"{np.median(finite):.0f}" if finite else "none"


def logprobs_cost(model, steps: int) -> tuple[list[str], dict]:
    prompts = [model.tokenizer.encode(text)[:48] for text in lee_articles()[:RECORDS]]
    options = RuntimeOptions(max_batch_size=RECORDS, num_pages=1024)
    engines = {}
    for name, k in (("logprobs=0", 0), ("logprobs=5", 5)):
        engine = build_engine(model.weights, model.config, model.tokenizer, options, 1024)
        settings = RequestSettings(max_new_tokens=900, ignore_eos=True, logprobs=k)
        handles = [engine.submit(p, settings) for p in prompts]
        while any(h.sequence.status is not Status.RUNNING for h in handles):
            engine.step()
        engines[name] = engine
    times: dict[str, list[float]] = {name: [] for name in engines}
    for repeat in range(steps + 2):  # two warm-up rounds
        for name, engine in engines.items():
            started = time.perf_counter()
            engine.step()
            if repeat >= 2:
                times[name].append((time.perf_counter() - started) / options.steps_per_sync)
    base = np.asarray(times["logprobs=0"])
    lines = [
        f"| batch {RECORDS} decode step | ms per step (median) | spread | vs logprobs=0 "
        "(paired median) |",
        "|---|---|---|---|",
    ]
    for name, values in times.items():
        v = np.asarray(values)
        lines.append(
            f"| {name} | {1e3 * np.median(v):.1f} | {1e3 * v.min():.1f}-{1e3 * v.max():.1f} "
            f"| {np.median(v / base):.3f}x |"
        )
    return lines, times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12, help="logprobs rounds per engine")
    parser.add_argument("--write", action="store_true", help="rewrite the docs/PERF.md section")
    args = parser.parse_args()
    model = etjax.load_model()
    others, wall = _others_cpu_seconds(), time.perf_counter()
    table, extracted = extraction(model, args.repeats)
    lp_table, _ = logprobs_cost(model, args.steps)
    others = (_others_cpu_seconds() - others) / (time.perf_counter() - wall)
    load = (
        f"**under load**: other processes used {others:.2f} cores on average during the run"
        if others > 0.1
        else f"other processes used {others:.2f} cores during the run"
    )
    command = (
        f".venv/bin/python benchmarks/structured_output.py --repeats {args.repeats} "
        f"--steps {args.steps} --write"
    )
    markdown = "\n".join(
        [
            "## Structured output: JSON-schema extraction and logprobs (SmolLM2-135M, float32)",
            "",
            f"`{command}`, {time.strftime('%Y-%m-%d')}, {machine_line()}; {load}.",
            "",
            *table,
            "",
            *lp_table,
        ]
    )
    print(markdown)
    if args.write:
        replace_section(
            Path(__file__).resolve().parent.parent / "docs" / "PERF.md",
            "structured_output",
            markdown,
        )
    print(
        json.dumps(
            {
                "same_tokens": extracted["same_tokens"],
                "equal_lengths": extracted["equal_lengths"],
                "others_cores": others,
            }
        )
    )


if __name__ == "__main__":
    main()
