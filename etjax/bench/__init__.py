"""`etjax bench`: the paper's ablation, rerunnable on a real model with one command.

    etjax bench --workload mixed \
        --configs baseline,sampling_only,scheduling_only,pruning_only,speculative_only,full

Modules, in the order a run touches them: `corpus` (the Lee articles), `workloads` (`mixed`,
`online`), `ablation` (the plan and its order of work), `measure` (one config on one workload,
timed), `perplexity`, `passkey`, `text_metrics` and `reference` (quality and the transformers
yardstick), `report` (the tables), `plots` (the PNGs), `perf_doc` (sections of docs/PERF.md),
`output` (where it all is written). Needs the `bench` extra: pip install 'etjax[bench]'.
"""

from etjax.bench.ablation import BenchPlan, run_ablation

__all__ = ["BenchPlan", "run_ablation"]
