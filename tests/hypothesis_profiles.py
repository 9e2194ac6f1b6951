"""Hypothesis profiles: a deterministic default for CI, and a deeper random one on demand.

- `ci` (the default): derandomized, so every run draws the same examples and a test passes or
  fails by the code alone, never by the draw; no example database (nothing an earlier run left
  behind changes what runs); no deadline, since the first example of a test may compile.
- `deep` (`ETJAX_HYPOTHESIS=deep make test`, or with `.venv/bin/pytest`): random draws, ten
  times the examples, and the example database, so failures found once are replayed. Run it
  before a release or after touching a property-tested module; reproduce a failure it finds
  with the seed it prints (`--hypothesis-seed=N`).

Tests size their example counts with `examples(n)`: n under `ci`, 10 n under `deep`.
"""

from __future__ import annotations

import os

from hypothesis import settings

PROFILE = os.environ.get("ETJAX_HYPOTHESIS", "ci")
if PROFILE not in ("ci", "deep"):
    raise ValueError(f"ETJAX_HYPOTHESIS={PROFILE!r}: expected 'ci' or 'deep'")

settings.register_profile(
    "ci", derandomize=True, deadline=None, database=None, print_blob=True, max_examples=100
)
settings.register_profile("deep", derandomize=False, deadline=None, max_examples=1000)
settings.load_profile(PROFILE)


def examples(n: int) -> int:
    """The example count of a test that runs `n` examples in CI."""
    return n if PROFILE == "ci" else 10 * n
