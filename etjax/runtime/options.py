"""How the engine is sized, what a request produced, and what it asks for (`RequestSettings`,
described with every request field in etjax/request_fields.py)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from etjax.attention.backend import BACKENDS as ATTENTION_BACKENDS
from etjax.calibration.file import Calibration
from etjax.distributed.mesh import MeshShape
from etjax.drafting.config import SpeculationConfig
from etjax.errors import FieldError
from etjax.experts.config import ExpertConfig
from etjax.pruning.config import PruningConfig
from etjax.request_fields import RequestSettings as RequestSettings  # where the engine reads it

POLICIES = ("fcfs", "priority", "entropic")
KV_DTYPES = ("auto", "model", "float32", "float16", "bfloat16")
MAX_PAGE_SIZE = 1024


@dataclass(frozen=True)
class RuntimeOptions:
    """Engine sizes and policies.

    max_batch_size: device batch slots, the sequences one decode burst advances.
    max_resident: sequences holding KV pages at once (>= max_batch_size); the scheduler picks
      which of them fill the device batch each round. None = 2 x max_batch_size.
    num_pages: KV pool size including the null page; None sizes it: on a TPU the largest
      pool beside the weights, the row store and the compiled programs' scratch in
      `hbm_fraction` of each chip's HBM (etjax/planning/pool.py, as `etjax plan` counts it);
      elsewhere for the work at hand when the engine is built for a known set of requests
      (`generate_ids`), else 4096.
    hbm_fraction: the share of each TPU chip's HBM the engine plans to fill (weights, pool,
      row store, programs), the rest left to the runtime; read on a TPU only.
    max_context: the most tokens (prompt and output) one request may come to; a request that
      needs more is refused, naming this field. None: the model's context. It bounds the
      step programs' attention work lists (sized for rows of this length, not of the
      model's context or the whole pool: on a TPU they live in the chips' scalar memory,
      which a long-context model's rows overflowed), and it is the context `etjax plan
      --context` plans for. Other engines call it max_model_len.
    steps_per_sync: decode steps per burst (one `lax.scan`) between scheduler decisions, in
      rounds with nothing to prefill. Larger amortises host work; smaller streams more
      smoothly and reacts faster.
    prefill_chunk: the most tokens of one prompt a round prefills; max_prefill_rows: the most
      prompts a round prefills.
    token_budget: the most tokens one ragged step runs: a token for each decoding row, then
      prefill chunks up to the rest (must exceed max_batch_size, so prefill always advances).
    policy: "fcfs", "priority" or "entropic" (etjax/engine/policies.py).
    min_advance_rounds: every resident sequence runs at least once in this many rounds.
    max_batch_groups: a round's batch may run as up to this many bursts of rows of similar
      attention width, when that reads fewer bytes (etjax/engine/grouping.py); 1 = one burst.
    attention_backend: the attention kernels: "auto" (Pallas on a TPU or a GPU; on a CPU the
      C++ decode kernel where it builds and one device runs the engine, else XLA), "xla",
      "cpu", "pallas_tpu" or "pallas_gpu". Dense steps run the ragged kernel of
      that backend (on a TPU mesh the XLA one), pruned steps its block-sparse kernel
      (etjax/attention/seam.py). A Pallas backend on a CPU runs interpreted: slow, for tests.
    mesh: "DATAxMODEL" devices of this process to run on ("2x4": rows split two ways, weights,
      KV heads and vocabulary four ways; etjax/distributed). "1x1" = the default device.
    compilation_cache: keep compiled programs on disk for later processes
      (etjax/compilation_cache.py; ETJAX_COMPILATION_CACHE=off also turns it off).
    speculation: drafting and verification of tokens (etjax/drafting, off by default); needs
      1 + max_draft <= steps_per_sync (the pages a round reserves). Under pruning, each
      drafted token reads the kept blocks a plain pruned step at its position would.
    calibration: the model's entropy calibration (etjax/calibration; `load_model(...,
      calibration=PATH)` attaches one): pruning, the scheduler and drafting then read the
      calibrated entropy, and the trace has it beside the raw one. None: they read the raw
      model entropy (and the trace's calibrated entropy equals it).
    prefix_cache: share the KV pages of a context's cached beginning between requests
      (etjax/cache/prefix_cache.py): a prompt whose first pages an earlier or running
      request holds, or left behind, prefills only the rest. Cached pages live as long as
      the engine, evicted least recently used when the pool needs them. Dense decode bursts
      read pages that rows share once for all of them (etjax/attention/cascade.py).
    kv_dtype: of the cached keys and values: "auto" (the default: the model's dtype, except
      that a bfloat16 model on a CPU gets float16), "model" (the model's dtype, always),
      "float32", "float16" or "bfloat16". A 16-bit cache halves the memory per token of
      context and the bytes each step reads; attention still computes in float32. On a CPU,
      float16 is the fast one (half the bytes to gather; keys and values past 65504
      saturate), while XLA:CPU writes into a bfloat16 pool by converting all of it to
      float32 and back, which made a decode step 32x slower (docs/PERF.md, "kv_dtype"): hence
      "auto". On accelerators bfloat16 is native.
    experts: entropy-steered experts (etjax/experts, off by default; an experiment): on a
      mixture-of-experts model, a decode token drawn from a distribution of entropy below
      `experts.entropy_threshold` runs `experts.reduced_top_k` of its k routed experts.
      Refused for a model without routed experts.
    """

    page_size: int = 16
    max_batch_size: int = 32
    max_resident: int | None = None
    num_pages: int | None = None
    hbm_fraction: float = 0.95
    max_context: int | None = None
    prefill_chunk: int = 512
    max_prefill_rows: int = 8
    token_budget: int = 512
    steps_per_sync: int = 8
    pruning: PruningConfig = field(default_factory=PruningConfig)
    policy: str = "fcfs"
    min_advance_rounds: int = 4
    max_batch_groups: int = 4
    attention_backend: str = "auto"
    mesh: str = "1x1"
    compilation_cache: bool = True
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    calibration: Calibration | None = None
    prefix_cache: bool = True
    kv_dtype: str = "auto"
    experts: ExpertConfig = field(default_factory=ExpertConfig)

    def __post_init__(self) -> None:
        self._check_values()
        self._check_together()

    def _check_values(self) -> None:
        # Each field on its own: its type and range (FieldError naming it).
        if not isinstance(self.prefix_cache, bool):
            raise FieldError("prefix_cache", self.prefix_cache, "true or false")
        if self.kv_dtype not in KV_DTYPES:
            raise FieldError("kv_dtype", self.kv_dtype, f"one of {KV_DTYPES}")
        if self.policy not in POLICIES:
            raise FieldError("policy", self.policy, f"one of {POLICIES}")
        for name in (
            "page_size",
            "max_batch_size",
            "prefill_chunk",
            "max_prefill_rows",
            "token_budget",
            "steps_per_sync",
            "min_advance_rounds",
            "max_batch_groups",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise FieldError(name, value, "a positive integer")
        for name in ("max_resident", "num_pages", "max_context"):
            value = getattr(self, name)
            bad = isinstance(value, bool) or not isinstance(value, int) or value <= 0
            if value is not None and bad:
                raise FieldError(name, value, "a positive integer or omitted")
        fraction = self.hbm_fraction
        number = isinstance(fraction, (int, float)) and not isinstance(fraction, bool)
        if not number or not 0 < fraction <= 1:
            raise FieldError("hbm_fraction", fraction, "a number in (0, 1]")
        MeshShape.parse(self.mesh)  # raises ConfigError naming the value
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise FieldError(
                "attention_backend", self.attention_backend, f"one of {ATTENTION_BACKENDS}"
            )

    def _check_together(self) -> None:
        # What the sizes must be against each other and the engine's limits.
        if self.page_size > MAX_PAGE_SIZE:
            raise FieldError(
                "page_size",
                self.page_size,
                f"at most {MAX_PAGE_SIZE} tokens (a page is one attention tile: every step "
                "gathers whole pages)",
            )
        if self.token_budget <= self.max_batch_size:
            raise FieldError(
                "token_budget",
                self.token_budget,
                f"more than max_batch_size={self.max_batch_size}: a step holds a token per "
                "decoding row and prefill",
            )
        if self.speculation.enabled and self.speculation.max_draft + 1 > self.steps_per_sync:
            need = self.speculation.max_draft + 1
            raise FieldError(
                "steps_per_sync",
                self.steps_per_sync,
                f">= {need}: speculation.max_draft={need - 1} needs steps_per_sync >= {need} "
                "(a round reserves pages for steps_per_sync tokens)",
            )
        if self.max_resident is not None and self.max_resident < self.max_batch_size:
            raise FieldError(
                "max_resident",
                self.max_resident,
                f">= max_batch_size={self.max_batch_size}: every batch slot needs a resident "
                "sequence",
            )

    def kv_cache_dtype(self, model_dtype: str, platform: str | None = None) -> str | None:
        """`kv_dtype` as the cache of a `model_dtype` model on `platform` (default: JAX's)
        takes it: None for the model's own dtype. "auto" stores a bfloat16 model's keys and
        values as float16 on a CPU: the same 16 bits a token, more mantissa, and writes in
        place (a bfloat16 pool is rewritten whole by every write there)."""
        if self.kv_dtype == "auto":
            if model_dtype != "bfloat16":
                return None
            if platform is None:
                import jax

                platform = jax.default_backend()
            return "float16" if platform == "cpu" else None
        return None if self.kv_dtype == "model" else self.kv_dtype

    def context_limit(self, model_context: int) -> int:
        """The most tokens a request may come to on an engine of a model of `model_context`
        positions: `max_context`, which may not exceed the model's (FieldError), else the
        model's."""
        if self.max_context is None:
            return model_context
        if self.max_context > model_context:
            raise FieldError(
                "max_context",
                self.max_context,
                f"at most the model's context, {model_context} tokens",
            )
        return self.max_context

    @property
    def mesh_shape(self) -> MeshShape:
        return MeshShape.parse(self.mesh)

    @property
    def resident_rows(self) -> int:
        return self.max_resident or 2 * self.max_batch_size


# What ended a row at a token, by the code the step reports it with (`StepOutputs.finish`):
# the device decides (etjax/runtime/commit.py), the host only reads it. A stop string, which
# needs the text, is the host's.
FINISH_REASONS = ("", "eos", "length")  # "": the row goes on


def _traced(step_output: str):
    # A trace list, filled from the StepOutputs field `step_output` (etjax/runtime/state.py).
    return field(default_factory=list, metadata={"step_output": step_output})


@dataclass
class Trace:
    """The per-token trace of the entropy signal: each list holds one value per generated
    token. `SequenceOutput` and `etjax.Result` both carry it, and whatever moves a trace
    (the engine, `decode()`, the server) loops over its fields: a new trace field is one line
    here, naming the `StepOutputs` field the engine reads it from, plus where the step
    computes it."""

    # entropy at T = 1 (nats) of the distribution drawn from: the model's, or for a
    # constrained request the model's renormalised over the tokens its grammar allowed
    entropy: list[float] = _traced("model_entropy")
    raw_entropy: list[float] = _traced("raw_entropy")  # the model's, whole vocabulary
    # the signal the engine read: the calibrated entropy (= entropy without a calibration)
    calibrated_entropy: list[float] = _traced("calibrated_entropy")
    logprob: list[float] = _traced("logprob")  # of the token under the model, T = 1
    sampled_entropy: list[float] = _traced("sampled_entropy")  # of the distribution sampled
    temperature: list[float] = _traced("temperature")  # 0 = greedy
    tau: list[float] = _traced("tau")  # entropic time after each token
    cost_flops: list[float] = _traced("cost_flops")  # cumulative, prefill included
    cost_bytes: list[float] = _traced("cost_bytes")  # cumulative, prefill included
    kept_blocks: list[int] = _traced("kept_blocks")  # blocks read per layer and KV head


# Each trace field and the StepOutputs field the engine reads it from.
TRACE_FIELDS: dict[str, str] = {f.name: f.metadata["step_output"] for f in fields(Trace)}


@dataclass
class SequenceOutput(Trace):
    """What one prompt produced, with the per-token trace of the entropy signal (`Trace`)."""

    token_ids: list[int] = field(default_factory=list)
    # Of those, per token, the blocks read once for the rows sharing the prefix, less this
    # row's share (etjax/attention/cascade.py `blocks_read_for_others`): 0 unless shared.
    shared_blocks: list[float] = field(default_factory=list)
    # With logprobs=k: per token, its k most likely (token id, log-probability) pairs at
    # T = 1 before penalties, most likely first; None when not asked.
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # With prompt_logprobs: prompt token j's log-probability given the tokens before it, at
    # T = 1 (None for the first); None when not asked.
    prompt_logprobs: list[float | None] | None = None
    text: str = ""
    # "eos", "stop" (a stop string), "length", "cancelled", or "error": the grammar engine
    # failed on a constrained request (`error` says why; the text need not match)
    finish_reason: str = ""
    error: str | None = None
    # Latencies (s) and counts, see engine.py `_stamp_finish`; among them what drafting did
    # (DRAFT_COUNTS): model_passes (the decode passes that gave it tokens), drafted_tokens,
    # accepted_tokens (of those drafted) and verify_steps (the passes that verified drafts).
    metrics: dict[str, float] = field(default_factory=dict)


# The per-request counts of what drafting did (speculation's lookups, a grammar's forced
# runs), as `SequenceOutput.metrics` names them; `etjax.Result` has each as a field.
DRAFT_COUNTS = ("model_passes", "drafted_tokens", "accepted_tokens", "verify_steps")
