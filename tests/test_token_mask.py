"""The constrained step's device half (etjax/runtime/token_mask.py) and its host callbacks
(etjax/constraints/matcher.py): a program that fails between the two callbacks leaves nothing
pending once the next step has run, and that step gets its own masks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback

from etjax.constraints import matcher
from etjax.runtime.token_mask import collect_masks, start_masks

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
