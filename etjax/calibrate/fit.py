"""`calibrate`: fit the temperature of a model's entropy signal to text, with optax.

The text is cut into windows of `window` tokens, each run through the model from an empty
cache (teacher forcing: `prefill_chunk` with every position's logits); position i's logits
predict token i + 1. The temperature T minimises the mean next-token NLL

    NLL(T) = mean_i [ logsumexp(z_i / T) - z_i[y_i] / T ],

which is convex in 1/T, over log T with L-BFGS (`optax.lbfgs`, its zoom line search). The fit
draws nothing at random: the same text gives the same temperature, bit for bit on one machine.
Minimising NLL is what makes the entropy an honest forecast of the surprisal: the derivative
of NLL in 1/T is mean(E_p[z] - z_y), zero exactly when the expected logit under the model
equals the realised one on average.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

from etjax.attention import padded_batch_plan
from etjax.cache.kv_cache import init_kv_cache
from etjax.calibrate.metrics import summarise, token_statistics
from etjax.calibration.file import MAX_TEMPERATURE, MIN_TEMPERATURE, Calibration
from etjax.calibration.identity import model_identity
from etjax.calibration.ramp import ramp_shift
from etjax.errors import CalibrationError
from etjax.loaders.loaded_model import Model
from etjax.pruning.budget import kept_fraction
from etjax.pruning.config import PruningConfig
from etjax.runtime.steps import prefill_chunk

WINDOW = 512  # tokens per teacher-forced window (a short context: the first tokens see little)
MAX_TOKENS = 4096  # positions the fit holds: tokens x vocabulary x 4 bytes of logits
# Fewest scored positions a fit, or a held-out report, takes. The fit sets T where the mean
# of a per-token term (E_p[z] - z_y, spread over a nat or more) is zero, and that error
# shrinks only as 1/sqrt(N): from a handful of tokens the temperature describes those tokens,
# not the model, and lands on a clip bound as often as not. With the Fisher information of
# log T near 1 to 5 per token, 128 tokens (a paragraph or two) put its standard error near 5%.
MIN_TOKENS = 128
PAGE = 16
_WHY = "the fitted temperature's error shrinks only as 1/sqrt(tokens)"
_CHUNK = 256  # rows per softmax in the objective (bounds the [rows, V] intermediates)


@dataclass(frozen=True)
class TemperatureFit:
    """What `fit_temperature` found: T, the mean NLL at T = 1 and at T, L-BFGS iterations."""

    temperature: float
    nll_before: float
    nll_after: float
    iterations: int


def mean_nll(log_t: jax.Array, logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean NLL of `targets` [N] under softmax(logits [N, V] / exp(log_t)), chunked over rows
    (N a multiple of the chunk, see `_pad_rows`; padded rows have target -1 and count 0)."""
    z = logits.reshape(-1, _CHUNK, logits.shape[1])
    y = targets.reshape(-1, _CHUNK)
    inverse = jnp.exp(-log_t)

    def chunk_sum(args):
        zc, yc = args
        x = zc * inverse
        picked = jnp.take_along_axis(x, jnp.maximum(yc, 0)[:, None], axis=1)[:, 0]
        return jnp.sum(jnp.where(yc >= 0, jax.nn.logsumexp(x, axis=-1) - picked, 0.0))

    return jnp.sum(jax.lax.map(chunk_sum, (z, y))) / jnp.sum(targets >= 0)


def fit_temperature(
    logits: jax.Array | np.ndarray,
    targets: jax.Array | np.ndarray,
    max_iterations: int = 50,
    tolerance: float = 1e-6,
) -> TemperatureFit:
    """The temperature minimising the mean NLL of `targets` [N] int under `logits` [N, V].

    Shapes and dtypes are checked (chex) before anything is traced: a transposed or
    mismatched pair fails here, with both shapes in the message, not inside XLA. Stops when
    |dNLL/dlog T| < `tolerance` or after `max_iterations` L-BFGS steps.
    """
    chex.assert_rank(logits, 2)
    chex.assert_rank(targets, 1)
    chex.assert_equal_shape_prefix([logits, targets], 1)
    chex.assert_type(targets, int)
    chex.assert_type(logits, float)
    z, y = _pad_rows(jnp.asarray(logits, jnp.float32), jnp.asarray(targets, jnp.int32))
    params = jnp.zeros((), jnp.float32)  # log T, from T = 1
    state = _OPTIMISER.init(params)
    before = float(mean_nll(params, z, y))
    iterations = 0
    for iterations in range(1, max_iterations + 1):  # noqa: B007  (the count is reported)
        params, state, grad = _lbfgs_step(params, state, z, y)
        if abs(float(grad)) < tolerance:
            break
    log_t = float(np.clip(params, np.log(MIN_TEMPERATURE), np.log(MAX_TEMPERATURE)))
    after = float(mean_nll(jnp.float32(log_t), z, y))
    return TemperatureFit(float(np.exp(log_t)), before, after, iterations)


_OPTIMISER = optax.lbfgs()


@jax.jit
def _lbfgs_step(params, state, logits, targets):
    # One L-BFGS step on log T; returns the gradient at the point it started from.
    def objective(p):
        return mean_nll(p, logits, targets)

    value, grad = optax.value_and_grad_from_state(objective)(params, state=state)
    updates, state = _OPTIMISER.update(
        grad, state, params, value=value, grad=grad, value_fn=objective
    )
    return optax.apply_updates(params, updates), state, grad


def _pad_rows(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    # Rows up to a multiple of the objective's chunk; padded rows have target -1.
    pad = (-logits.shape[0]) % _CHUNK
    return (
        jnp.pad(logits, ((0, pad), (0, 0))),
        jnp.pad(targets, (0, pad), constant_values=-1),
    )


def text_windows(model: Model, texts: Sequence[str], window: int = WINDOW) -> list[list[int]]:
    """Each text's tokens cut into windows of at most `window` tokens (at least 2). Where the
    tokenizer starts a text with BOS, every window starts with it (as a model expects)."""
    tok = model.tokenizer
    windows = []
    for text in texts:
        ids = tok.encode(text)
        head = ids[:1] if tok.add_bos_token and ids[:1] == [tok.bos_token_id] else []
        body = ids[len(head) :]
        step = window - len(head)
        windows += [head + body[i : i + step] for i in range(0, len(body), step)]
    return [w for w in windows if len(w) >= 2]


def window_logits(
    model: Model, windows: Sequence[Sequence[int]], window: int = WINDOW
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Teacher-forced (logits [n - 1, V] float32, targets [n - 1] int32) of each window of n
    tokens, run one at a time from an empty cache through one compiled prefill program."""
    cfg = model.config
    if window % PAGE:
        raise CalibrationError(f"window={window}; must be a multiple of {PAGE}")
    pages = window // PAGE
    cache = init_kv_cache(cfg, pages + 1, PAGE)
    table = (1 + np.arange(pages, dtype=np.int32))[None]
    for ids in windows:
        n = len(ids)
        tokens = np.zeros(window, np.int32)
        tokens[:n] = ids
        plan, write_pages = padded_batch_plan(
            table,
            np.zeros(1, np.int32),
            np.array([n], np.int32),
            window,
            PAGE,
            cfg.attention_window,
        )
        logits, cache = prefill_chunk(
            model.weights,
            cache,
            tokens,
            np.arange(window, dtype=np.int32),
            write_pages,
            np.arange(window, dtype=np.int32),
            plan,
            cfg=cfg,
        )
        yield np.asarray(logits[: n - 1]), np.asarray(ids[1:], np.int32)


def teacher_forced(
    model: Model, texts: Sequence[str], window: int = WINDOW, max_tokens: int = MAX_TOKENS
) -> tuple[np.ndarray, np.ndarray]:
    """Logits [N, V] and targets [N] of the first `max_tokens` scored positions of `texts`."""
    parts, total = [], 0
    for logits, targets in window_logits(model, text_windows(model, texts, window), window):
        take = min(len(targets), max_tokens - total)
        parts.append((logits[:take], targets[:take]))
        total += take
        if total >= max_tokens:
            break
    if not parts:
        raise CalibrationError("the text holds no token to score (at least two tokens needed)")
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def evaluate(
    model: Model,
    texts: Sequence[str],
    temperatures: Sequence[float],
    window: int = WINDOW,
    max_tokens: int | None = None,
) -> list[dict[str, float]]:
    """Calibration figures of `model` on `texts` at each temperature (metrics.summarise),
    streamed window by window (no logits held beyond one window)."""
    return [summarise(s) for s in text_statistics(model, texts, temperatures, window, max_tokens)]


def text_statistics(
    model: Model,
    texts: Sequence[str],
    temperatures: Sequence[float],
    window: int = WINDOW,
    max_tokens: int | None = None,
) -> list[dict[str, np.ndarray]]:
    """`token_statistics` of every scored position of `texts` (the first `max_tokens`), at
    each temperature: one dict of [N] arrays per temperature."""
    stats: list[dict[str, list]] = [{} for _ in temperatures]
    total = 0
    for logits, targets in window_logits(model, text_windows(model, texts, window), window):
        if max_tokens is not None:
            logits, targets = logits[: max_tokens - total], targets[: max_tokens - total]
        total += len(targets)
        for t, acc in zip(temperatures, stats, strict=True):
            out = token_statistics(jnp.asarray(logits), jnp.asarray(targets), jnp.float32(t))
            for key, value in out.items():
                acc.setdefault(key, []).append(np.asarray(value))
        if max_tokens is not None and total >= max_tokens:
            break
    return [{k: np.concatenate(v) for k, v in acc.items()} for acc in stats]


def calibrate(
    model: Model,
    texts: str | Sequence[str],
    held_out: str | Sequence[str] | None = None,
    window: int = WINDOW,
    max_tokens: int = MAX_TOKENS,
) -> Calibration:
    """Fit the temperature of `model`'s entropy signal to `texts` (a string or a list of
    them), minimising the next-token NLL of their first `max_tokens` scored positions.

    Returns a `Calibration` (save it with `etjax.calibration.file.save_calibration`, load it
    with `etjax.load_model(..., calibration=PATH)`), its `fit` recording the NLL, the
    top-token ECE and the mean entropy - surprisal gap before and after, on this text and,
    with `held_out` (other text, up to `max_tokens` positions), on that text: a fit is judged
    on text it did not see. Its `ramp_shift` is fitted on `texts` too: the shift of the
    pruning ramp that keeps the default budget under the calibrated signal
    (etjax/calibration/ramp.py).
    """
    texts = _text_list(texts, "texts")
    held = None if held_out is None else _text_list(held_out, "held_out")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < MIN_TOKENS:
        raise CalibrationError(
            f"max_tokens (--max-tokens) = {max_tokens!r}; must be an integer >= {MIN_TOKENS}, "
            f"the fewest scored tokens a fit takes ({_WHY})"
        )
    if isinstance(window, bool) or not isinstance(window, int) or window < PAGE or window % PAGE:
        raise CalibrationError(
            f"window (--window) = {window!r}; must be a positive multiple of {PAGE}"
        )
    # Counted before any logit is computed: a fit refused after minutes of work wastes them.
    # (The text is tokenized again below; tokenizing costs little beside the model.)
    for name, flag, given in (("texts", "--text", texts), ("held_out", "--held-out", held)):
        if given is not None:
            scored = sum(len(w) - 1 for w in text_windows(model, given, window))
            if scored < MIN_TOKENS:
                raise CalibrationError(
                    f"{name} ({flag}) holds {scored} scored token{'s' * (scored != 1)}; a "
                    f"calibration needs at least {MIN_TOKENS} ({_WHY}): give more text"
                )
    logits, targets = teacher_forced(model, texts, window, max_tokens)
    fit = fit_temperature(logits, targets)
    temperatures = (1.0, fit.temperature)
    stats = [_statistics(logits, targets, t) for t in temperatures]
    del logits
    figures = {"fit": [summarise(s) for s in stats]}
    # The pruning ramp on the calibrated scale: the shift that keeps, on this same text, the
    # default setting's budget (etjax/calibration/ramp.py).
    raw_entropy, calibrated_entropy = (s["entropy"] for s in stats)
    shift = ramp_shift(raw_entropy, calibrated_entropy)
    if held is not None:
        figures["held_out"] = evaluate(model, held, temperatures, window, max_tokens)
    record: dict = {
        "tokens": int(targets.size),
        "window": window,
        "optimizer": "optax.lbfgs",
        "iterations": fit.iterations,
        # The default ramp's mean kept fraction on the fit text, raw (preserved by the shift).
        "ramp_kept_fraction": float(np.mean(kept_fraction(raw_entropy, PruningConfig(), np))),
    }
    for where, (before, after) in figures.items():
        prefix = "" if where == "fit" else "held_out_"
        if where == "held_out":
            record["held_out_tokens"] = before["tokens"]
        for name in ("nll", "ece", "entropy_gap", "entropy_gap_binned"):
            record[f"{prefix}{name}_before"] = before[name]
            record[f"{prefix}{name}_after"] = after[name]
    return Calibration(
        temperature=fit.temperature,
        model=model.name,
        vocab_size=model.config.vocab_size,
        fit=record,
        ramp_shift=shift,
        identity=model_identity(model),
    )


def _statistics(logits: np.ndarray, targets: np.ndarray, temperature: float) -> dict:
    stats = token_statistics(jnp.asarray(logits), jnp.asarray(targets), jnp.float32(temperature))
    return {k: np.asarray(v) for k, v in stats.items()}


def _text_list(texts: str | Sequence[str], name: str) -> list[str]:
    if isinstance(texts, str):
        texts = [texts]
    if not texts or not all(isinstance(t, str) for t in texts):
        raise CalibrationError(f"{name}: pass a string or a non-empty list of strings")
    return list(texts)
