"""`RunSummary`: the statistics a batch job reports, kept as the results stream past.

A finished request adds its counts and latencies and is forgotten: the summary of a million
requests holds a few sums and two quantile sketches, never the requests' outputs or traces.
"""

from __future__ import annotations

from pathlib import Path

from etjax.jobs.quantile_sketch import QuantileSketch
from etjax.runtime.options import SequenceOutput


class RunSummary:
    def __init__(self) -> None:
        self.requests = 0
        self.generated_tokens = 0
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0  # of them, found in the prefix cache
        self._latency_sum = 0.0
        self._ttft_sum = 0.0
        self._latency = QuantileSketch()
        self._ttft = QuantileSketch()

    def add(self, out: SequenceOutput) -> None:
        self.requests += 1
        self.generated_tokens += len(out.token_ids)
        self.prompt_tokens += int(out.metrics["prompt_tokens"])
        self.cached_prompt_tokens += int(out.metrics["cached_tokens"])
        latency = out.metrics["end_to_end_latency"]
        ttft = out.metrics["time_to_first_token"]
        self._latency_sum += latency
        self._ttft_sum += ttft
        self._latency.add(max(latency, 0.0))
        self._ttft.add(max(ttft, 0.0))

    def as_dict(self, results_file: Path, records: int, run_now: int, wall: float) -> dict:
        """The summary written beside the results; quantiles are within 1% (QuantileSketch)."""
        n = max(self.requests, 1)
        return {
            "results_file": str(results_file),
            "records": records,
            "run_now": run_now,
            "generated_tokens": self.generated_tokens,
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            # The share of prompt tokens the prefix cache served (each sample counts its own).
            "prefix_cache_hit_rate": self.cached_prompt_tokens / self.prompt_tokens
            if self.prompt_tokens
            else 0.0,
            "wall_seconds": wall,
            "throughput_tokens_per_s": self.generated_tokens / wall if wall > 0 else 0.0,
            "latency_mean_s": self._latency_sum / n,
            "latency_p50_s": self._latency.quantile(0.5),
            "latency_p99_s": self._latency.quantile(0.99),
            "time_to_first_token_mean_s": self._ttft_sum / n,
            "time_to_first_token_p99_s": self._ttft.quantile(0.99),
        }
