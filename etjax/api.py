"""The public entry points: `load_model` and `decode`."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from etjax.errors import RequestError
from etjax.loaders.loaded_model import Model
from etjax.loaders.resolve import load_model
from etjax.pruning.config import PruningConfig
from etjax.runtime.generate import RequestSettings, RuntimeOptions, generate_ids
from etjax.sampling.settings import SamplerSettings

__all__ = ["Result", "decode", "load_model"]


@dataclass
class Result:
    """The outcome of one prompt.

    Per generated token i (the trace): `entropy[i]` is the model's next-token entropy in nats at
    temperature 1 of the distribution `token_ids[i]` was drawn from; `logprob[i]` the token's
    log-probability under that distribution; `sampled_entropy[i]` the
    entropy of the distribution actually sampled (after penalties, temperature and filters; 0
    when greedy); `temperature[i]` the temperature used; `tau[i]` entropic time so far;
    `cost_flops[i]` and `cost_bytes[i]` the cumulative cost, prompt included
    (`etjax.entropy.cost`); `kept_blocks[i]` the KV blocks per layer and KV head the model read
    after drawing token i (all of them unless `pruning` is on). `finish_reason` is "eos",
    "stop", "length", or None when the prompt was rejected, in which case `error` says why and
    nothing was generated.
    """

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)
    entropy: list[float] = field(default_factory=list)
    logprob: list[float] = field(default_factory=list)
    sampled_entropy: list[float] = field(default_factory=list)
    temperature: list[float] = field(default_factory=list)
    tau: list[float] = field(default_factory=list)
    cost_flops: list[float] = field(default_factory=list)
    cost_bytes: list[float] = field(default_factory=list)
    kept_blocks: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def decode(
    prompts: str | Sequence[str],
    *,
    model: Model | str | Path | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    seed: int = 0,
    sampler: str = "standard",
    stop: str | Sequence[str] | None = None,
    ignore_eos: bool = False,
    chat: bool = False,
    system_prompt: str | None = None,
    raise_on_invalid: bool = False,
    max_batch_size: int = 32,
    page_size: int = 16,
    pruning: PruningConfig | bool = False,
    on_text: Callable[[int, str], None] | None = None,
    **sampler_options: float,
) -> list[Result]:
    """Generate a continuation of each prompt.

    Args:
      prompts: one string or a list of strings.
      model: a `Model` from `load_model`, a name or a path (default: the embedded
        SmolLM2-135M-Instruct). Names and paths are loaded once and cached.
      max_new_tokens: tokens to generate at most (>= 1).
      temperature: 0 for greedy decoding, else the softmax temperature.
      seed: sampling seed; a prompt samples the same tokens alone or in a batch.
      sampler: "standard", "mirostat_v2", "edt" or "entropic" (see `SamplerSettings`).
      stop: strings that end generation; the text is cut before them.
      ignore_eos: keep generating past end-of-sequence tokens (exactly `max_new_tokens`).
      chat: wrap each prompt as a user turn in the model's chat template.
      system_prompt: optional system turn when `chat` is set.
      raise_on_invalid: raise `RequestError` for an invalid prompt instead of returning a
        `Result` with `error` set (the other prompts are generated either way otherwise).
      pruning: True (default settings) or a `PruningConfig`: entropic attention pruning — each
        decode step reads only the KV blocks its entropy budget and query keep.
      on_text: called as `on_text(prompt_index, text_piece)` while text is produced.
      **sampler_options: any other `etjax.sampling.SamplerSettings` field (top_k, top_p, min_p,
        typical_p, repetition_penalty, presence_penalty, frequency_penalty, target_entropy,
        t_min, t_max, gain, entropy_floor, mirostat_tau, edt_theta, ...).

    Returns:
      One `Result` per prompt, in order.
    """
    prompt_list = _prompt_list(prompts)
    settings = RequestSettings(
        max_new_tokens=_positive_int("max_new_tokens", max_new_tokens),
        ignore_eos=bool(ignore_eos),
        stop=_stop_strings(stop),
        sampler=_sampler_settings(sampler, temperature, seed, sampler_options),
    )
    if isinstance(pruning, bool):
        pruning = PruningConfig(enabled=pruning)
    options = RuntimeOptions(
        page_size=_positive_int("page_size", page_size),
        max_batch_size=_positive_int("max_batch_size", max_batch_size),
        pruning=pruning,
    )
    model = _resolve_model(model)
    results = [Result() for _ in prompt_list]
    valid: list[int] = []
    for i, prompt in enumerate(prompt_list):
        ids, error = _tokenize(model, prompt, i, chat, system_prompt, settings.max_new_tokens)
        results[i].prompt_token_ids = ids
        if error is None:
            valid.append(i)
        elif raise_on_invalid:
            raise RequestError(error)
        else:
            results[i].error = error
    if not valid:
        return results
    callback = None if on_text is None else (lambda row, piece: on_text(valid[row], piece))
    outputs = generate_ids(
        model.weights,
        model.config,
        model.tokenizer,
        [results[i].prompt_token_ids for i in valid],
        [settings] * len(valid),
        options,
        callback,
    )
    for i, out in zip(valid, outputs, strict=True):
        r = results[i]
        r.text, r.token_ids, r.finish_reason = out.text, out.token_ids, out.finish_reason
        r.entropy, r.logprob, r.sampled_entropy, r.temperature = (
            out.entropy,
            out.logprob,
            out.sampled_entropy,
            out.temperature,
        )
        r.tau, r.cost_flops, r.cost_bytes = out.tau, out.cost_flops, out.cost_bytes
        r.kept_blocks = out.kept_blocks
    return results


def _sampler_settings(
    sampler: str, temperature: object, seed: object, options: dict[str, float]
) -> SamplerSettings:
    known = set(SamplerSettings.__dataclass_fields__) - {"sampler", "temperature", "seed"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise RequestError(f"unknown sampler option {unknown[0]!r}; allowed: {sorted(known)}")
    return SamplerSettings(
        sampler=sampler, temperature=_temperature(temperature), seed=_seed(seed), **options
    )


@functools.lru_cache(maxsize=2)
def _load_cached(name_or_path: str) -> Model:
    return load_model(name_or_path)


def _resolve_model(model: Model | str | Path | None) -> Model:
    if isinstance(model, Model):
        return model
    if model is None or isinstance(model, str | Path):
        return _load_cached("smollm2-135m-instruct" if model is None else str(model))
    raise RequestError(
        f"model={type(model).__name__}; pass a Model from etjax.load_model, a name or a path"
    )


def _prompt_list(prompts: str | Sequence[str]) -> list:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, Sequence) and not isinstance(prompts, bytes):
        if len(prompts) == 0:
            raise RequestError("prompts is an empty list; pass at least one prompt")
        return list(prompts)
    raise RequestError(f"prompts must be a string or a list of strings, got {type(prompts)}")


def _tokenize(
    model: Model, prompt: object, index: int, chat: bool, system: str | None, max_new: int
) -> tuple[list[int], str | None]:
    if not isinstance(prompt, str):
        return [], f"prompt {index} is a {type(prompt).__name__}, not a string"
    if not prompt.strip():
        return [], f"prompt {index} is empty"
    if chat:
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": prompt})
        ids = model.tokenizer.encode_chat(messages, add_generation_prompt=True)
    else:
        ids = model.tokenizer.encode(prompt)
    context = model.config.max_position_embeddings
    if len(ids) + max_new > context:
        return ids, (
            f"prompt {index} has {len(ids)} tokens; with max_new_tokens={max_new} it needs "
            f"{len(ids) + max_new} positions but the model's context is {context}"
        )
    return ids, None


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise RequestError(f"{name}={value!r}; must be a positive integer")
    return value


def _temperature(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RequestError(f"temperature={value!r}; must be a number >= 0 (0 = greedy)")
    if not math.isfinite(value) or value < 0:
        raise RequestError(f"temperature={value!r}; must be a finite number >= 0 (0 = greedy)")
    return float(value)


def _seed(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**32:
        raise RequestError(f"seed={value!r}; must be an integer in [0, 2**32)")
    return value


def _stop_strings(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else list(stop)
    for s in items:
        if not isinstance(s, str) or not s:
            raise RequestError(f"stop={stop!r}; each stop sequence must be a non-empty string")
    return tuple(items)
