"""The constrained step's device half (etjax/runtime/token_mask.py) and its host callbacks
(etjax/constraints/matcher.py): a program that fails between the two callbacks leaves nothing
pending once the next step has run, and that step gets its own masks; and the rows a step
masks, gathered or in place, sample and report what NumPy computes for their masks while
the other rows' are untouched."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback

from etjax.calibration.signal import CalibrationParams
from etjax.constraints import matcher
from etjax.engine.row_store import empty_store
from etjax.runtime.commit import sample_rows
from etjax.runtime.token_mask import collect_masks, mask_rows, start_masks

VOCAB = 64
WIDTH = matcher.mask_words(VOCAB)


class NextTokenOnly:
    """A test double of llguidance's matcher: after token t it allows token t + 1 alone."""

    def __init__(self) -> None:
        self.last = -1

    def consume_token(self, token: int) -> None:
        self.last = token

    def compute_bitmask(self) -> bytes:
        words = np.zeros(WIDTH, np.uint32)
        allowed = self.last + 1
        words[allowed // 32] = np.uint32(1) << np.uint32(allowed % 32)
        return words.tobytes()

    def is_error(self) -> bool:
        return False


def _fail(x):
    raise RuntimeError("a step failing between the callbacks")


@jax.jit(static_argnames="broken")
def _step(gid: jax.Array, token: jax.Array, index: jax.Array, broken: bool) -> jax.Array:
    # One row's draw handed to the host, the work between the callbacks (failing if
    # `broken`), the masks collected.
    committed = jnp.ones(1, bool)
    token, ticket = start_masks(gid, token, index, committed, WIDTH)
    if broken:
        shape = jax.ShapeDtypeStruct(token.shape, token.dtype)
        token = io_callback(_fail, shape, token, ordered=True)
    return collect_masks(ticket, token, 1, WIDTH)


@pytest.fixture
def row():
    gid = 2**31 - 7  # an id `register` does not reach
    matcher._registry[gid] = matcher.RowGrammar(NextTokenOnly(), VOCAB)
    yield jnp.full(1, gid, jnp.int32)
    matcher.release(gid)


def _allowed(masks: jax.Array) -> list[int]:
    bits = np.unpackbits(np.asarray(masks)[0].view(np.uint8), bitorder="little")
    return np.flatnonzero(bits).tolist()


def test_a_step_failing_between_the_callbacks_leaves_nothing_pending(row):
    with pytest.raises(Exception, match="failing between the callbacks"):
        jax.block_until_ready(_step(row, jnp.full(1, 3), jnp.zeros(1, jnp.int32), broken=True))
    # The next step collects its own masks (token 5 -> only 6; the failed step's would say 4)
    # and leaves nothing behind.
    masks = _step(row, jnp.full(1, 5), jnp.ones(1, jnp.int32), broken=False)
    assert _allowed(masks) == [6]
    assert not matcher.pending()
    assert _allowed(_step(row, jnp.full(1, 6), jnp.full(1, 2, jnp.int32), broken=False)) == [7]
    assert not matcher.pending()


@dataclasses.dataclass(frozen=True)
class _Vocab:
    vocab_size: int


@pytest.mark.parametrize("count", [2, 4, 8])  # gathered, gathered with spare slots, in place
def test_masked_rows_sample_their_allowed_tokens_and_the_others_are_untouched(count):
    # Greedy rows of random logits, two of eight constrained to random token sets. The truth,
    # in NumPy: a constrained row draws the best allowed token and reports the entropy of the
    # softmax renormalised over its allowed tokens, its raw entropy and signal the whole
    # vocabulary's (row 5's signal at its calibration temperature 2); every other row is
    # the plain softmax's. However many slots the program masks, the answer is the same.
    b, v = 8, 200
    rng = np.random.default_rng(7)
    logits = rng.normal(0.0, 3.0, (b, v)).astype(np.float32)
    allowed = np.ones((b, v), bool)
    constrained = np.zeros(b, bool)
    for row in (2, 5):
        allowed[row] = rng.random(v) < 0.1
        constrained[row] = True
    words = np.packbits(
        np.pad(allowed, ((0, 0), (0, 32 * matcher.mask_words(v) - v))), bitorder="little"
    ).view(np.uint32)
    store = empty_store(_Vocab(v), b, (0,))
    temperature = np.ones(b, np.float32)
    temperature[5] = 2.0
    state = store.replace(
        logits=jnp.asarray(logits),
        active=jnp.ones(b, bool),
        max_new_tokens=jnp.full(b, 10, jnp.int32),
        allowed=jnp.asarray(words.reshape(b, -1)),
        grammar=jnp.asarray(np.where(constrained, 1, -1), jnp.int32),
        calibration=CalibrationParams(temperature=jnp.asarray(temperature)),
    )

    @jax.jit
    def step(state):
        masked_logits, masked = mask_rows(
            state.logits, state.allowed, state.active & (state.grammar >= 0), count
        )
        tokens, info, _ = sample_rows(state.replace(logits=masked_logits), masked)
        return tokens, info.model_entropy, info.raw_entropy, info.calibrated_entropy

    tokens, entropy, raw, signal = (np.asarray(x) for x in step(state))

    def softmax_entropy(z):
        p = np.exp(z - z.max())
        p /= p.sum()
        return float(-(p[p > 0] * np.log(p[p > 0])).sum())

    for row in range(b):
        z = logits[row].astype(np.float64)
        ok = allowed[row]
        assert tokens[row] == np.flatnonzero(ok)[np.argmax(z[ok])]
        assert entropy[row] == pytest.approx(softmax_entropy(z[ok]), abs=1e-4)
        assert raw[row] == pytest.approx(softmax_entropy(z), abs=1e-4)
        assert signal[row] == pytest.approx(softmax_entropy(z / temperature[row]), abs=1e-4)
