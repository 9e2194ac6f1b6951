"""The public entry points: `load_model` and `decode`."""

from __future__ import annotations

import dataclasses
import functools
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from etjax.drafting import SpeculationConfig
from etjax.engine_build import RuntimeOptions, generate_ids
from etjax.errors import RequestError
from etjax.experts.config import ExpertConfig
from etjax.loaders.loaded_model import Model
from etjax.loaders.resolve import load_model
from etjax.model.config import DTYPE_CHOICES, resolve_dtype
from etjax.progress import Progress
from etjax.pruning.config import PruningConfig
from etjax.request_checks import (
    flag,
    positive_int,
    request_seeds,
    sampler_settings,
    tokenize_prompt,
)
from etjax.request_fields import DECODE, FIELDS, build_request, open_at, read_fields
from etjax.runtime.options import DRAFT_COUNTS, TRACE_FIELDS, Trace

__all__ = ["Result", "decode", "load_model"]


@dataclass
class Result(Trace):
    """The outcome of one prompt.

    Per generated token i (the trace): `entropy[i]` is the next-token entropy in nats at
    temperature 1 of the distribution `token_ids[i]` was drawn from: the model's, or for a
    constrained request (`json_schema`, `regex`, `choices`, `grammar`) the model's
    renormalised over the tokens the constraint allowed (0 where it allowed one token; the
    entropic controller holds its target over it); `raw_entropy[i]` the model's entropy over
    the whole vocabulary (equal to `entropy[i]` without a constraint; pruning, the scheduler
    and drafting read it); `logprob[i]` the token's log-probability under the distribution it
    was drawn from at T = 1; `sampled_entropy[i]` the
    entropy of the distribution actually sampled (after penalties, temperature and filters; 0
    when greedy); `temperature[i]` the temperature used; `tau[i]` entropic time so far;
    `calibrated_entropy[i]` the entropy signal pruning, the scheduler and drafting read: the
    entropy under the model's calibration (`load_model(..., calibration=PATH)`), equal to
    `entropy[i]` without one;
    `cost_flops[i]` and `cost_bytes[i]` the cumulative cost, prompt included
    (`etjax.entropy.cost`); `kept_blocks[i]` the KV blocks per layer and KV head the model read
    after drawing token i (all of them unless `pruning` is on). With `logprobs=k`,
    `top_logprobs[i]` holds the k most likely `(token_id, logprob)` pairs at token i, most
    likely first, of the same distribution as `logprob[i]`: the model's at temperature 1
    (renormalised over the allowed tokens under a constraint, and then only allowed tokens:
    fewer than k where fewer are allowed), before penalties, temperature and filters (None
    when not asked). With
    `prompt_logprobs=True`, `prompt_logprobs[j]` is prompt token j's log-probability given
    the tokens before it, of the model's distribution at temperature 1 (None for the first
    token; the whole list None when not asked). `finish_reason` is "eos" (under a
    constraint: the output satisfies it), "stop", "length" (also for a constrained output cut
    by `max_new_tokens`, which then need not parse), "error" when the grammar engine failed
    on a constrained request while generating (`error` names the constraint and llguidance's
    reason; the text need not match), or None when the prompt was rejected, in which case
    `error` says why and nothing was generated.

    What drafting did (speculation, or a constraint's forced tokens), per request:
    `model_passes` the decode passes of the model that gave it tokens (a burst step or a
    ragged step each, verifying or not; its prompt's prefill not counted), so
    `len(token_ids)` without drafts; `drafted_tokens` the tokens it drafted,
    `accepted_tokens` how many of them verification accepted (each one a token without a
    pass of its own: `len(token_ids) == model_passes + accepted_tokens` unless a stop string
    cut a pass's tokens), and `verify_steps` the passes that verified its drafts.
    """

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprobs: list[float | None] | None = None
    finish_reason: str | None = None
    error: str | None = None
    seed: int = 0  # the sampling seed it used: `decode(..., seed=[r.seed])` replays it
    cached_tokens: int = 0  # prompt tokens it found in the prefix cache (not prefilled again)
    model_passes: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None


def decode(
    prompts: str | Sequence[str | Sequence[dict]] | Sequence[dict],
    *,
    model: Model | str | Path | None = None,
    dtype: str = "auto",
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    seed: int | Sequence[int] | None = None,
    n: int = 1,
    sampler: str = "standard",
    stop: str | Sequence[str] | None = None,
    ignore_eos: bool = False,
    logprobs: int = 0,
    prompt_logprobs: bool = False,
    json_schema: dict | str | None = None,
    regex: str | None = None,
    choices: Sequence[str] | None = None,
    grammar: str | None = None,
    chat: bool = False,
    system_prompt: str | None = None,
    trusted_chat: bool = False,
    raise_on_invalid: bool = False,
    max_batch_size: int = 32,
    page_size: int = 16,
    max_context: int | None = None,
    pruning: PruningConfig | bool = False,
    speculation: SpeculationConfig | bool = False,
    experts: ExpertConfig | bool = False,
    prefix_cache: bool = True,
    kv_dtype: str = "auto",
    mesh: str = "1x1",
    on_text: Callable[[int, str], None] | None = None,
    progress: bool = False,
    **sampler_options: float,
) -> list[Result]:
    """Generate a continuation of each prompt.

    Args:
      prompts: one prompt or a list of them. A prompt is a string, or a conversation: a list
        of {"role": "system" | "user" | "assistant", "content": str} messages, rendered by the
        model's chat template with the assistant's turn opened (a list of messages alone is
        one conversation).
      model: a `Model` from `load_model`, a name or a path (default: the embedded
        SmolLM2-135M-Instruct). Names and paths are loaded once and cached.
      dtype: of the weights, activations and KV cache when `model` is a name or a path:
        "auto" (bfloat16 on a TPU or a GPU, float32 on a CPU), "float32" or "bfloat16".
      temperature: 0 for greedy decoding, else the softmax temperature.
      seed: None (fresh random seeds), an integer (each request its own reproducible stream,
        derived from the seed and the request's place in the call), or a list with one seed
        per request, used as given. Every `Result` reports its `.seed`: pass `seed=[r.seed]`
        with the same prompt and settings to replay it, alone or in any batch.
      sampler: "standard", "mirostat_v2", "edt" or "entropic" (see `SamplerSettings`).
      <request fields>: each described once in etjax/request_fields.py; help(decode) lists them.
      raise_on_invalid: raise `RequestError` for an invalid prompt instead of returning a
        `Result` with `error` set (the other prompts are generated either way otherwise).
      max_context: the most tokens (prompt and output) a request may come to; a longer one
        gets an error `Result`. None: the model's context. The step programs' attention work
        lists are sized for rows of this length: on a TPU, give it for a long-context model
        (docs/TPU.md).
      pruning: True (default settings) or a `PruningConfig`: entropic attention pruning — each
        decode step reads only the KV blocks its entropy budget and query keep.
      speculation: True (default settings) or a `SpeculationConfig`: after confident tokens,
        sequences draft tokens from their prompt and output and verify them in one pass; the
        outputs are the same as without it. With `pruning` too, each drafted token reads
        the kept blocks a plain pruned step at its position would.
      experts: True (default settings) or an `ExpertConfig`: entropy-steered experts, an
        experiment (etjax/experts): on a mixture-of-experts model, a decode token drawn from
        a distribution of entropy below `entropy_threshold` runs `reduced_top_k` of its k
        routed experts. Refused for a model without routed experts.
      prefix_cache: requests (and the n samples of a prompt) whose prompts start alike share
        the KV pages of that beginning: it is prefilled once, by the first of them (the
        other samples of a prompt start from its last logits, prefilling nothing), and
        decode steps read it once for the rows holding it (etjax/attention/cascade.py). The
        cache lives for this call. Greedy outputs are the same with it off; log-probabilities
        agree to float rounding (a seeded draw can differ where rounding moves it across a
        token boundary).
      kv_dtype: of the KV cache: "auto" (the weights' dtype, but float16 for a bfloat16
        model on a CPU), "model" (the weights' dtype), "float32", "float16" or "bfloat16"
        (half the memory per token of context; keys and values rounded, attention in
        float32). On a CPU float16 is also faster and bfloat16 slower (docs/USAGE.md).
      mesh: "DATAxMODEL" devices of this process to shard over ("1x8": weights, KV heads and
        vocabulary split 8 ways); see docs/SCALING.md. "1x1" runs on the default device.
      on_text: called as `on_text(result_index, text_piece)` while text is produced (the
        prompt's index when n = 1).
      progress: show requests done, tokens/s and an ETA (a bar in a terminal or a notebook,
        log lines to the `etjax` logger elsewhere).
      **sampler_options: any other `etjax.sampling.SamplerSettings` field (top_k, top_p, min_p,
        typical_p, repetition_penalty, presence_penalty, frequency_penalty, target_entropy,
        t_min, t_max, gain, entropy_floor, mirostat_tau, edt_theta, ...).

    Returns:
      n `Result`s per prompt, in order: prompt i's are `results[i * n:(i + 1) * n]`.
    """
    keywords = locals()  # the request fields are checked by their table, as given
    prompt_list = _prompt_list(prompts)
    raise_on_invalid = flag("raise_on_invalid", raise_on_invalid)
    given = {name: keywords[name] for name in open_at(DECODE)}
    # A request field closed to decode() (a record's priority) is named as such, not taken
    # for an unknown sampler option.
    given |= {k: sampler_options.pop(k) for k in list(sampler_options) if k in FIELDS}
    settings, asked = build_request(
        read_fields(given, DECODE), sampler_settings(sampler, temperature, 0, sampler_options)
    )
    n = asked.n
    seeds = request_seeds(seed, len(prompt_list) * n)
    if isinstance(pruning, bool):
        pruning = PruningConfig(enabled=pruning)
    elif not isinstance(pruning, PruningConfig):
        raise RequestError(f"pruning={pruning!r}; must be True, False or a PruningConfig")
    if isinstance(speculation, bool):
        speculation = SpeculationConfig(enabled=speculation)
    elif not isinstance(speculation, SpeculationConfig):
        raise RequestError(
            f"speculation={speculation!r}; must be True, False or a SpeculationConfig"
        )
    if isinstance(experts, bool):
        experts = ExpertConfig(enabled=experts)
    elif not isinstance(experts, ExpertConfig):
        raise RequestError(f"experts={experts!r}; must be True, False or an ExpertConfig")
    max_batch_size = positive_int("max_batch_size", max_batch_size)
    options = RuntimeOptions(  # FieldError for what they cannot take together
        page_size=positive_int("page_size", page_size),
        max_batch_size=max_batch_size,
        # A step holds a token per decoding row before any prefill: grow the budget.
        token_budget=max(RuntimeOptions.token_budget, 2 * max_batch_size),
        pruning=pruning,
        mesh=mesh,
        speculation=speculation,
        experts=experts,
        prefix_cache=flag("prefix_cache", prefix_cache),
        kv_dtype=kv_dtype,
        max_context=max_context,
    )
    model = _resolve_model(model, dtype)
    context = options.context_limit(model.config.max_position_embeddings)
    options = dataclasses.replace(options, calibration=model.calibration)
    # Result k is sample k % n of prompt k // n, with its own seed.
    results = [Result(seed=s) for s in seeds]
    valid: list[int] = []
    for i, prompt in enumerate(prompt_list):
        ids, error = tokenize_prompt(
            model,
            prompt,
            i,
            chat=asked.chat,
            system=asked.system_prompt,
            max_new=settings.max_new_tokens,
            trusted_chat=asked.trusted_chat,
            context=context,
        )
        if error is not None and raise_on_invalid:
            raise RequestError(error)
        for k in range(i * n, (i + 1) * n):
            results[k].prompt_token_ids, results[k].error = list(ids), error
            if error is None:
                valid.append(k)
    if not valid:
        return results
    callback = None if on_text is None else (lambda row, piece: on_text(valid[row], piece))
    bar = Progress(len(valid)) if flag("progress", progress) else None
    done = None if bar is None else (lambda _, out: bar.update(1, len(out.token_ids)))
    outputs = generate_ids(
        model.weights,
        model.config,
        model.tokenizer,
        [results[k].prompt_token_ids for k in valid],
        [
            dataclasses.replace(
                settings, sampler=dataclasses.replace(settings.sampler, seed=results[k].seed)
            )
            for k in valid
        ],
        options,
        callback,
        done,
    )
    if bar is not None:
        bar.close()
    for k, out in zip(valid, outputs, strict=True):
        r = results[k]
        r.text, r.token_ids, r.finish_reason = out.text, out.token_ids, out.finish_reason
        r.error = out.error
        for name in TRACE_FIELDS:
            setattr(r, name, getattr(out, name))
        r.top_logprobs, r.prompt_logprobs = out.top_logprobs, out.prompt_logprobs
        for name in ("cached_tokens", *DRAFT_COUNTS):
            setattr(r, name, int(out.metrics.get(name, 0)))
    return results


def _with_request_fields(doc: str) -> str:
    # decode()'s request keywords are described in their table; help(decode) shows them here.
    lines = []
    for name, row in open_at(DECODE).items():
        lines += textwrap.wrap(
            f"{name}: {row.help}.", 96, initial_indent="  " * 3, subsequent_indent="  " * 4
        )
    marker = next(line for line in doc.splitlines() if "<request fields>" in line)
    return doc.replace(marker, "\n".join(lines))


decode.__doc__ = _with_request_fields(decode.__doc__)


@functools.lru_cache(maxsize=2)
def _load_cached(name_or_path: str, dtype: str) -> Model:
    return load_model(name_or_path, dtype=dtype)


def _resolve_model(model: Model | str | Path | None, dtype: str) -> Model:
    if dtype not in DTYPE_CHOICES:
        raise RequestError(f"dtype={dtype!r}; allowed: {DTYPE_CHOICES}")
    if isinstance(model, Model):
        if dtype != "auto" and dtype != model.config.dtype:
            raise RequestError(
                f"dtype={dtype!r} but the model given is loaded as {model.config.dtype}; "
                "pass dtype to etjax.load_model, or a name or path here"
            )
        return model
    if model is None or isinstance(model, str | Path):
        name = "smollm2-135m-instruct" if model is None else str(model)
        return _load_cached(name, resolve_dtype(dtype))
    raise RequestError(
        f"model={type(model).__name__}; pass a Model from etjax.load_model, a name or a path"
    )


def _prompt_list(prompts: str | Sequence) -> list:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, Sequence) and not isinstance(prompts, bytes):
        if len(prompts) == 0:
            raise RequestError("prompts is an empty list; pass at least one prompt")
        if all(isinstance(p, dict) for p in prompts):
            return [list(prompts)]  # one conversation
        return [list(p) if isinstance(p, tuple) else p for p in prompts]
    raise RequestError(
        f"prompts must be a string, a list of messages or a list of those, got {type(prompts)}"
    )
