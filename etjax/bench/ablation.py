"""The ablation: several named configs on one workload, side by side in one process.

The order of work, and why:

1. **Warm-up, not measured.** The workload runs once at once under every distinct engine
   setting (policy, sizes, pruning), so the programs its shapes need are compiled before any
   config is timed. Each timed run still records the seconds it spent compiling.
2. **Arrivals.** `mixed` submits everything at time 0. `online` (or any built-in workload
   with `arrivals`) draws Poisson arrivals at
   `load` (80%) of the capacity a warm at-once baseline run measured in this process, one
   draw per repetition (seeds `seed + 1`, `seed + 2`, ...: a figure's spread then includes
   the draw's, and one lucky draw cannot make a config's median), then warms every distinct
   setting again with the first draw: requests arriving one by one make batches of sizes
   that an at-once run never forms. (The at-once warm-up is then needed for the first config
   only, to measure its capacity warm.) A later draw may form a batch the first did not; its
   run then compiles, which its `compile_s` records.
3. **Timed runs, repetitions interleaved** (config A, B, ..., then A, B, ... again), so drift
   of a shared machine spreads over every config instead of biasing one. Every config of a
   repetition gets that repetition's arrivals.
4. **Quality.** Greedy outputs under each config's scheduling and pruning, against the
   baseline's greedy outputs (ROUGE-L, BLEU); teacher-forced long-context perplexity ratio and
   passkey accuracy under each config's pruning. Sampling does not enter these: a greedy
   output is the argmax whatever the temperature. Configs with equal pruning give equal greedy
   tokens (scheduling never changes tokens, which the sampled runs check as well), so each
   distinct pruning setting is evaluated once.
5. **Reference.** transformers `generate`, greedy, on the same requests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from etjax.bench.corpus import lee_articles
from etjax.bench.measure import measure, summarise
from etjax.bench.passkey import passkey_cases, run_passkey
from etjax.bench.perplexity import long_documents, perplexity, prefill_documents
from etjax.bench.text_metrics import corpus_bleu, rouge_l
from etjax.bench.workload_file import is_workload_file, read_workload_file
from etjax.bench.workloads import WORKLOADS, build_workload, poisson_arrivals
from etjax.errors import ConfigError
from etjax.run_config import RunConfig, load_run_config


@dataclass(frozen=True)
class BenchPlan:
    """What `etjax bench` measures; every field has a command-line flag."""

    workload: str = "mixed"
    configs: tuple[str, ...] = (
        "baseline",
        "sampling_only",
        "scheduling_only",
        "pruning_only",
        "speculative_only",
        "full",
    )
    model: str | None = None  # a model preset (configs/models/); None: each config's own
    requests: int = 64
    repetitions: int = 2
    seed: int = 0
    load: float = 0.8  # online: arrival rate as a fraction of measured capacity
    # Poisson arrivals at `load` for a built-in workload other than `online` (which is
    # `mixed` with them): `long` with arrivals is decode-bound serving.
    arrivals: bool = False
    quality: bool = True
    ppl_docs: int = 4
    ppl_length: int = 4096
    passkey_lengths: tuple[int, ...] = (1024, 2048, 4096)
    passkey_keys: int = 1
    reference: bool = True
    reference_batch: int = 1
    # Every request generates exactly its max_new_tokens under every config (no EOS): the
    # configs compared on equal work, which a sampler that delays or hastens EOS changes.
    equal_length: bool = False

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS and not is_workload_file(self.workload):
            raise ConfigError(
                f"workload {self.workload!r}; allowed: {sorted(WORKLOADS)} or a FILE.jsonl"
            )
        if not self.configs:
            raise ConfigError("configs: name at least one config")
        for name in ("requests", "repetitions", "ppl_docs", "ppl_length", "reference_batch"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}={getattr(self, name)}; must be positive")
        if not 0.0 < self.load <= 1.0:
            raise ConfigError(f"load={self.load}; must be in (0, 1]")
        if self.arrivals and is_workload_file(self.workload):
            raise ConfigError(
                f"arrivals: {self.workload} is a workload file, whose records give their own "
                "arrival times; drop --arrivals"
            )

    @property
    def online(self) -> bool:
        """Whether requests arrive as a Poisson process (`online`, or `arrivals`)."""
        return self.workload == "online" or self.arrivals


def run_ablation(plan: BenchPlan, on_progress: Callable[[str], None] = lambda _: None) -> dict:
    """Measure every config of `plan`; the raw record (JSON-serialisable).

    `on_progress(label)` is called as each piece of work starts, for a progress bar (see
    `count_work` for how many there are).
    """
    import etjax

    configs = [load_run_config(name, model=plan.model) for name in plan.configs]
    models = {c.model for c in configs}
    if len(models) > 1:
        raise ConfigError(
            f"configs {list(plan.configs)} name different models; compare one at a time"
        )
    choice = configs[0].model
    model = etjax.load_model(
        choice.name, dtype=choice.dtype, calibration=choice.calibration, weights=choice.weights
    )
    if is_workload_file(plan.workload):
        workload = read_workload_file(plan.workload, model)
    else:
        context = model.config.max_position_embeddings
        workload = build_workload(
            plan.workload, model.tokenizer, lee_articles(), plan.requests, plan.seed, context
        )
    at_once = np.array([r.arrival for r in workload])  # a file's own arrivals; else zeros
    raw: dict = {
        "model": f"{model.name}, {model.config.dtype}",
        "weights": model.weights_format,  # how the matrices are held: "q4_1+q8_0", "float32"
        "plan": dataclasses.asdict(plan),
        "workload": [dataclasses.asdict(r) for r in workload],
    }

    distinct = _distinct(configs, lambda c: c.options)
    online = plan.online
    # The warm-ups are the workload's cold runs: what they compiled is what a user's first
    # run of this workload compiles (the timed runs below compile nothing).
    warmups = raw["warm_up"] = {}
    for config in distinct[:1] if online else distinct:
        on_progress(f"warm-up ({config.name})")
        cold = measure(model, config, workload, at_once, equal_length=plan.equal_length)
        warmups[config.name] = {k: cold[k] for k in ("compile_s", "programs_compiled")}
    draws = [at_once] * plan.repetitions  # each repetition's arrivals
    if online:
        on_progress("capacity")
        probe = measure(model, configs[0], workload, at_once, equal_length=plan.equal_length)
        capacity = len(workload) / probe["makespan_s"]
        rate = plan.load * capacity
        draws = [
            poisson_arrivals(len(workload), rate, seed=plan.seed + 1 + rep)
            for rep in range(plan.repetitions)
        ]
        raw["capacity_requests_per_s"] = capacity
        # Arrivals make batches of other sizes than everything at once: warm those too.
        for config in distinct:
            on_progress(f"warm-up with arrivals ({config.name})")
            measure(model, config, workload, draws[0], equal_length=plan.equal_length)
    raw["arrivals"] = [list(map(float, arrivals)) for arrivals in draws]

    runs: dict[str, list[dict]] = {c.name: [] for c in configs}
    for rep, arrivals in enumerate(draws):
        for config in configs:
            on_progress(f"{config.name} (repetition {rep + 1})")
            run = measure(model, config, workload, arrivals, equal_length=plan.equal_length)
            runs[config.name].append(run)
    raw["runs"] = runs
    raw["summary"] = {name: [summarise(r) for r in rs] for name, rs in runs.items()}
    raw["same_tokens_as"] = _same_tokens(configs, runs)

    if plan.quality:
        raw["quality"] = _quality(plan, model, configs, workload, on_progress)
    if plan.reference:
        from etjax.bench.reference import load_reference, run_reference

        on_progress("transformers reference")
        hf = load_reference(choice.name)
        ref = run_reference(hf, model.tokenizer, workload, plan.reference_batch, plan.equal_length)
        baseline_greedy = raw.get("quality", {}).get("greedy_texts", {}).get(configs[0].name)
        if baseline_greedy is not None:
            texts = [r["text"] for r in ref["requests"]]
            ref["rouge_l_vs_baseline"] = float(np.mean(rouge_l(texts, baseline_greedy)))
            ref["bleu_vs_baseline"] = corpus_bleu(texts, baseline_greedy)
        raw["reference"] = ref
    return raw


def count_work(plan: BenchPlan) -> int:
    """How many `on_progress` calls `run_ablation(plan)` makes (an upper bound)."""
    configs = [load_run_config(name, model=plan.model) for name in plan.configs]
    warmups = len(_distinct(configs, lambda c: c.options))
    prunings = len(_distinct(configs, lambda c: c.options.pruning))
    quality = 3 * prunings if plan.quality else 0
    online = plan.online
    return (
        (1 + 1 + warmups if online else warmups)  # online: warm-up, capacity, arrival warm-ups
        + plan.repetitions * len(configs)
        + quality
        + plan.reference
    )


def _distinct(configs: list[RunConfig], key) -> list[RunConfig]:
    # The first config of every distinct key, in order.
    seen, chosen = set(), []
    for config in configs:
        if key(config) not in seen:
            seen.add(key(config))
            chosen.append(config)
    return chosen


def _same_tokens(configs: list[RunConfig], runs: dict[str, list[dict]]) -> dict[str, str]:
    # For every config, the first earlier config whose sampled tokens it reproduced exactly
    # (equal sampler and pruning must give equal tokens whatever the scheduling).
    tokens = {c.name: [r["token_ids"] for r in runs[c.name][0]["requests"]] for c in configs}
    found = {}
    for i, config in enumerate(configs):
        for earlier in configs[:i]:
            if tokens[earlier.name] == tokens[config.name]:
                found[config.name] = earlier.name
                break
    return found


def _quality(plan, model, configs, workload, on_progress) -> dict:
    articles = lee_articles()
    greedy: dict[str, list[str]] = {}
    ppl: dict[str, list[float]] = {}
    passkey: dict[str, dict] = {}
    prefilled = None
    cases = passkey_cases(list(plan.passkey_lengths), plan.passkey_keys)
    by_pruning: dict = {}
    for config in configs:
        pruning = config.options.pruning
        if pruning in by_pruning:
            continue
        by_pruning[pruning] = config.name
        on_progress(f"greedy outputs ({config.name})")
        run = measure(model, config, workload, np.zeros(len(workload)), greedy=True)
        greedy[config.name] = [r["text"] for r in run["requests"]]
        on_progress(f"long-context perplexity ({config.name})")
        if prefilled is None:
            docs = long_documents(model.tokenizer, articles, plan.ppl_docs, plan.ppl_length)
            prefilled = prefill_documents(model, docs)
        ppl[config.name] = perplexity(model, prefilled, pruning)
        on_progress(f"passkey ({config.name})")
        passkey[config.name] = run_passkey(model, cases, pruning)
    base = configs[0].name
    rows = {}
    for config in configs:
        source = by_pruning[config.options.pruning]
        rows[config.name] = {
            "evaluated_as": source,
            "rouge_l": float(np.mean(rouge_l(greedy[source], greedy[base]))),
            "bleu": corpus_bleu(greedy[source], greedy[base]),
            "ppl": ppl[source]["ppl"],
            "ppl_ratio": float(np.mean(np.array(ppl[source]["ppl"]) / np.array(ppl[base]["ppl"]))),
            "ppl_kept_fraction": ppl[source]["kept_fraction"],
            "passkey_accuracy": float(np.mean(passkey[source]["found"])),
            "passkey_found": passkey[source]["found"],
        }
    return {
        "rows": rows,
        "greedy_texts": greedy,
        "passkey_cases": [dataclasses.asdict(c) for c in cases],
    }
