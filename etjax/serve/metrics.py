"""`Metrics`: what `GET /metrics` shows, in Prometheus' text format (version 0.0.4).

Written here rather than with a client library: a dozen counters, gauges and histograms,
updated by the engine thread and read by the server's, under one lock. Names start with
`etjax_`; times are in seconds, entropies in nats.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from etjax.engine.engine import EngineStats

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
ENTROPY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 1.5, 2, 3, 4, 6, 8)  # nats
FRACTION_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


@dataclass
class Histogram:
    """Cumulative buckets (upper bounds), their sum and count, as Prometheus keeps them."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)  # the last: +Inf only

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += n
            le = "+Inf" if bound == float("inf") else repr(float(bound))
            out.append(f'{name}_bucket{{le="{le}"}} {running}')
        return [*out, f"{name}_sum {self.sum!r}", f"{name}_count {self.count}"]


# name -> (type, help); the order /metrics lists them in
DESCRIPTIONS: dict[str, tuple[str, str]] = {
    "etjax_requests_running": ("gauge", "Requests holding KV pages (prefilling or decoding)"),
    "etjax_requests_waiting": ("gauge", "Requests queued for admission"),
    "etjax_kv_pages_used": ("gauge", "KV pages live requests hold"),
    "etjax_kv_pages_free": ("gauge", "KV pages an allocation can get (free or idle cached)"),
    "etjax_kv_pages_total": ("gauge", "KV pages in the pool, the null page aside"),
    "etjax_requests_total": ("counter", "Requests answered, by outcome"),
    "etjax_prompt_tokens_total": ("counter", "Prompt tokens of accepted requests"),
    "etjax_generation_tokens_total": ("counter", "Tokens generated (cancelled requests' too)"),
    "etjax_preemptions_total": ("counter", "Requests preempted (pages freed, recomputed later)"),
    "etjax_model_passes_total": ("counter", "Decode passes that gave finished samples tokens"),
    "etjax_drafted_tokens_total": ("counter", "Tokens drafted for finished samples (speculation)"),
    "etjax_accepted_tokens_total": ("counter", "Drafted tokens their samples accepted"),
    "etjax_verify_steps_total": ("counter", "Steps that verified finished samples' drafts"),
    "etjax_prefix_cache_queries_total": ("counter", "Prompt tokens looked up in the prefix cache"),
    "etjax_prefix_cache_hits_total": ("counter", "Prompt tokens served by the prefix cache"),
    "etjax_time_to_first_token_seconds": ("histogram", "Arrival to first token"),
    "etjax_inter_token_latency_seconds": ("histogram", "Between tokens of a sample, per token"),
    "etjax_e2e_request_latency_seconds": ("histogram", "Arrival to last token"),
    "etjax_step_seconds": ("histogram", "One engine round (scheduler and device)"),
    "etjax_token_entropy_nats": ("histogram", "Next-token entropy of each generated token"),
    "etjax_kept_fraction": ("histogram", "Fraction of KV blocks a generated token read"),
}
_HISTOGRAMS = {
    "etjax_time_to_first_token_seconds": LATENCY_BUCKETS,
    "etjax_inter_token_latency_seconds": LATENCY_BUCKETS,
    "etjax_e2e_request_latency_seconds": LATENCY_BUCKETS,
    "etjax_step_seconds": LATENCY_BUCKETS,
    "etjax_token_entropy_nats": ENTROPY_BUCKETS,
    "etjax_kept_fraction": FRACTION_BUCKETS,
}
OUTCOMES = ("ok", "error", "cancelled", "timeout", "rejected")


def engine_values(stats: EngineStats) -> dict[str, float]:
    """What /metrics reads from the engine's own snapshot (`Engine.stats`), by the names
    `Metrics.set` takes: the gauges, and the counters the engine keeps itself."""
    return {
        "requests_running": stats.prefilling + stats.running,
        "requests_waiting": stats.waiting,
        "kv_pages_used": stats.kv_pages_used,
        "kv_pages_free": stats.kv_pages_free,
        "kv_pages_total": stats.kv_pages_total,
        "generation_tokens_total": stats.tokens_generated,
        "preemptions_total": stats.preemptions,
    }


class Metrics:
    """The server's counters, gauges and histograms; every method is thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, float] = {
            name: 0.0 for name, (kind, _) in DESCRIPTIONS.items() if kind != "histogram"
        }
        self._outcomes = dict.fromkeys(OUTCOMES, 0)
        self._histograms = {name: Histogram(b) for name, b in _HISTOGRAMS.items()}

    def set(self, **gauges: float) -> None:
        """Set gauges (or counters kept elsewhere) by name without the `etjax_` prefix
        (requests_running=3)."""
        with self._lock:
            for name, value in gauges.items():
                self._values[f"etjax_{name}"] = float(value)

    def add(self, **counters: float) -> None:
        """Add to counters by name without the prefix and `_total` (prompt_tokens=12)."""
        with self._lock:
            for name, value in counters.items():
                self._values[f"etjax_{name}_total"] += value

    def outcome(self, outcome: str) -> None:
        """Count one answered request: "ok", "error", "cancelled", "timeout" or "rejected"."""
        with self._lock:
            self._outcomes[outcome] += 1

    def observe(self, name: str, *values: float) -> None:
        """Observe values into a histogram, by name without the prefix (step_seconds)."""
        with self._lock:
            histogram = self._histograms[f"etjax_{name}"]
            for value in values:
                histogram.observe(value)

    def value(self, name: str) -> float:
        """A gauge's or counter's value by its full name (for tests and the load generator)."""
        with self._lock:
            return self._values[name]

    def render(self) -> str:
        """Every metric in Prometheus' text exposition format."""
        lines = []
        with self._lock:
            for name, (kind, help_text) in DESCRIPTIONS.items():
                lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
                if kind == "histogram":
                    lines += self._histograms[name].lines(name)
                elif name == "etjax_requests_total":
                    lines += [f'{name}{{outcome="{o}"}} {n}' for o, n in self._outcomes.items()]
                else:
                    lines.append(f"{name} {self._values[name]!r}")
        return "\n".join(lines) + "\n"
