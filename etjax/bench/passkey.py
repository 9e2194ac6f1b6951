"""Passkey retrieval (Mohtashami & Jaggi, 2023): can the model still find a needle when its
attention reads only some blocks?

A five-digit key is hidden at a chosen depth of repetitive filler text; the prompt ends by
asking for it, and the answer counts when the key appears among the first `NEW_TOKENS` greedy
tokens. The prompt is prefilled densely whatever the pruning; pruning applies to every decode
step, so the digits after the first are read through the pruned attention.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from etjax.pruning.config import PruningConfig

INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it.\n"
)
FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
QUESTION = "\nWhat is the pass key? The pass key is"
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
NEW_TOKENS = 16
PAGE = 16


@dataclass(frozen=True)
class PasskeyCase:
    length: int  # target prompt length in tokens
    depth: float  # where the key sits in the filler, 0 = start, 1 = end
    key: int


def passkey_cases(
    lengths: list[int], keys_per_cell: int, depths=DEPTHS, seed: int = 0
) -> list[PasskeyCase]:
    """Every (length, depth) cell with `keys_per_cell` random keys, deterministic in `seed`."""
    rng = random.Random(seed)
    return [
        PasskeyCase(n, d, rng.randrange(10_000, 100_000))
        for n in lengths
        for d in depths
        for _ in range(keys_per_cell)
    ]


def passkey_prompt(tokenizer, case: PasskeyCase) -> str:
    """A prompt of about `case.length` tokens with the key at `case.depth` of the filler."""
    needle = f"The pass key is {case.key}. Remember it. {case.key} is the pass key.\n"
    fixed = len(tokenizer.encode(INTRO + needle + QUESTION))
    per_filler = len(tokenizer.encode(FILLER * 10)) / 10
    repeats = max(int((case.length - fixed) / per_filler), 1)
    before = round(repeats * case.depth)
    return INTRO + FILLER * before + needle + FILLER * (repeats - before) + QUESTION


def run_passkey(
    model, cases: list[PasskeyCase], pruning: PruningConfig, max_batch_size: int = 8
) -> dict:
    """Answer every case greedily under `pruning`.

    Returns {"found": [bool per case], "answers": [text], "kept_fraction": mean fraction of
    blocks read per decode step}.
    """
    from etjax.api import decode

    prompts = [passkey_prompt(model.tokenizer, c) for c in cases]
    results = decode(
        prompts,
        model=model,
        max_new_tokens=NEW_TOKENS,
        max_batch_size=max_batch_size,
        page_size=PAGE,
        pruning=pruning,
    )
    kept = [
        blocks / -(-(len(r.prompt_token_ids) + i + 1) // PAGE)
        for r in results
        for i, blocks in enumerate(r.kept_blocks)
        if blocks > 0
    ]
    return {
        "found": [str(c.key) in r.text for r, c in zip(results, cases, strict=True)],
        "answers": [r.text for r in results],
        "kept_fraction": float(np.mean(kept)) if kept else 1.0,
    }
