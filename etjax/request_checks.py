"""The checks of a request beyond its fields' own (etjax/request_fields.py), shared by
`etjax.decode()` and batch-job records: sampler settings, seeds, and the prompt.

A bad setting raises `FieldError` naming the field, the value and what is allowed; a prompt
that cannot be served gets the reason, so that the other prompts still run.
"""

from __future__ import annotations

import hashlib
import math
import secrets

from etjax import request_fields
from etjax.errors import FieldError, RequestError
from etjax.loaders.loaded_model import Model
from etjax.request_fields import checked, switch
from etjax.sampling.settings import SamplerSettings


def sampler_settings(
    sampler: str, temperature: object, seed: object, options: dict[str, float]
) -> SamplerSettings:
    known = set(SamplerSettings.__dataclass_fields__) - {"sampler", "temperature", "seed"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise RequestError(f"unknown sampler option {unknown[0]!r}; allowed: {sorted(known)}")
    return SamplerSettings(
        sampler=sampler,
        temperature=temperature_value(temperature),
        seed=seed_value(seed),
        **options,
    )


MESSAGE_ROLES = {"system", "user", "assistant"}


def tokenize_prompt(
    model: Model,
    prompt: object,
    index: int,
    chat: bool,
    system: str | None,
    max_new: int,
    trusted_chat: bool = False,
    context: int | None = None,
) -> tuple[list[int], str | None]:
    """The prompt's token ids and, if it cannot be served, why. A prompt is a string (a user
    turn in the chat template when `chat`) or a list of {"role", "content"} messages (always
    rendered by the chat template, the assistant's turn opened). `context`: the most tokens
    a request may come to on the engine that serves it (`RuntimeOptions.context_limit`;
    None: the model's context)."""
    if context is None:
        context = model.config.max_position_embeddings
    if isinstance(prompt, list):
        return _tokenize_messages(model, prompt, index, system, max_new, trusted_chat, context)
    if not isinstance(prompt, str):
        return [], (
            f"prompt {index} is a {type(prompt).__name__}; a prompt is a string or a list of "
            '{"role", "content"} messages'
        )
    if not prompt.strip():
        return [], f"prompt {index} is empty"
    for name, text in (("prompt", prompt), ("system_prompt", system or "")):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            # A lone surrogate ("\ud800" in JSON) is a str but no text: no tokenizer takes it.
            return [], (
                f"{name} {index} holds a lone surrogate {text[e.start]!r} at character "
                f"{e.start}; it is not text"
            )
    if chat:
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": prompt})
        # Untrusted unless said otherwise: special-token text in the content stays text.
        ids = model.tokenizer.encode_chat(
            messages, add_generation_prompt=True, trusted=trusted_chat
        )
    else:
        ids = model.tokenizer.encode(prompt)
    return ids, _context_error(model, ids, index, max_new, context)


def _context_error(
    model: Model, ids: list[int], index: int, max_new: int, context: int
) -> str | None:
    if len(ids) + max_new > context:
        limit = f"the model's context is {context}"
        if context != model.config.max_position_embeddings:
            limit = f"the engine's context is {context} (max_context)"
        return (
            f"prompt {index} has {len(ids)} tokens; with max_new_tokens={max_new} it needs "
            f"{len(ids) + max_new} positions but {limit}"
        )
    return None


def _tokenize_messages(
    model: Model,
    messages: list,
    index: int,
    system: str | None,
    max_new: int,
    trusted_chat: bool,
    context: int,
) -> tuple[list[int], str | None]:
    # A conversation, rendered by the model's chat template with the assistant's turn opened.
    if not messages:
        return [], f"prompt {index} is an empty list of messages"
    for j, message in enumerate(messages):
        where = f"prompt {index}, message {j}"
        if not isinstance(message, dict) or set(message) != {"role", "content"}:
            return [], f'{where}: must be an object with exactly "role" and "content"'
        role, content = message["role"], message["content"]
        if role not in MESSAGE_ROLES:
            return [], f"{where}: role={role!r}; allowed: {sorted(MESSAGE_ROLES)}"
        if not isinstance(content, str):
            return [], f"{where}: content is a {type(content).__name__}, not a string"
        try:
            content.encode("utf-8")
        except UnicodeEncodeError as e:
            return [], f"{where}: content holds a lone surrogate at character {e.start}"
    if system is not None:
        if any(m["role"] == "system" for m in messages):
            return [], f"prompt {index} has a system message and system_prompt is set; use one"
        messages = [{"role": "system", "content": system}, *messages]
    ids = model.tokenizer.encode_chat(messages, add_generation_prompt=True, trusted=trusted_chat)
    return ids, _context_error(model, ids, index, max_new, context)


def flag(name: str, value: object) -> bool:
    """A yes/no setting of `decode()` that is no request field (raise_on_invalid, progress)."""
    return checked(name, value, switch)


def positive_int(name: str, value: object) -> int:
    """An engine size `decode()` takes (max_batch_size, page_size)."""
    return checked(name, value, request_fields.positive_int)


def temperature_value(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise FieldError("temperature", value, "a number >= 0 (0 = greedy)")
    if not math.isfinite(value) or value < 0:
        raise FieldError("temperature", value, "a finite number >= 0 (0 = greedy)")
    return float(value)


def seed_value(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**32:
        raise FieldError("seed", value, "an integer in [0, 2**32)")
    return value


def derived_seed(seed: int, key: object) -> int:
    """A well-mixed 32-bit seed for stream `key` (a prompt's index, a record's id) of `seed`:
    every prompt of a call (every record of a job) gets its own reproducible stream."""
    digest = hashlib.sha256(f"{seed}:{type(key).__name__}:{key}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def request_seeds(seed: object, count: int) -> list[int]:
    """The seed of each of `count` requests: fresh random ones for None, one stream per
    request derived from an integer, or a list of `count` seeds used as they are (to replay
    results, whose `.seed` says which they used)."""
    if seed is None:
        return [secrets.randbits(32) for _ in range(count)]
    if isinstance(seed, list | tuple):
        if len(seed) != count:
            raise RequestError(f"seed is a list of {len(seed)}; one per request needs {count}")
        return [seed_value(s) for s in seed]
    return [derived_seed(seed_value(seed), i) for i in range(count)]
