"""Seeded workloads built from the gensim Lee corpus (300 news articles).

`mixed(n, seed)`: three quarters short requests (the opening of one article with an
instruction to summarise, continue, or answer a question about it) and one quarter long
documents (consecutive articles joined to 2K-6K tokens, to be summarised), each with 64-256
new tokens drawn uniformly. `poisson_arrivals(n, rate, seed)`: arrival times (seconds) of a
Poisson process of `rate` requests per second.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

INSTRUCTIONS = {
    "summarise": "Summarise the following news article in two sentences.\n\n{text}\n\nSummary:",
    "continue": "{text}",
    "question": "{text}\n\nQuestion: Who is the main person or group in this article, and what "
    "did they do?\nAnswer:",
}


@dataclass(frozen=True)
class WorkloadRequest:
    kind: str  # "summarise" | "continue" | "question" | "long"
    prompt: str
    max_new_tokens: int


def mixed(tokenizer, articles: list[str], n: int = 64, seed: int = 0) -> list[WorkloadRequest]:
    """The `mixed` workload (see the module docstring), deterministic in `seed`."""
    rng = random.Random(seed)
    requests = []
    for i in range(n):
        new = rng.randint(64, 256)
        if i % 4 == 3:
            target = rng.randint(2048, 6144)
            start, parts, size = rng.randrange(len(articles)), [], 0
            while size < target:
                text = articles[(start + len(parts)) % len(articles)]
                parts.append(text)
                size += len(tokenizer.encode(text))
            document = "\n\n".join(parts)
            ids = tokenizer.encode(document)[: target - 32]
            prompt = (
                "Summarise the main events reported below.\n\n"
                + tokenizer.decode(ids)
                + "\n\nSummary:"
            )
            requests.append(WorkloadRequest("long", prompt, new))
        else:
            kind = rng.choice(sorted(INSTRUCTIONS))
            article = articles[rng.randrange(len(articles))]
            text = tokenizer.decode(tokenizer.encode(article)[: rng.randint(64, 384)])
            requests.append(WorkloadRequest(kind, INSTRUCTIONS[kind].format(text=text), new))
    return requests


WORKLOADS = {
    "mixed": "the mixed requests, all submitted at once",
    "online": "the mixed requests with Poisson arrivals at a fraction of measured capacity",
}


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> np.ndarray:
    """Arrival times [n] in seconds of a Poisson process with `rate` arrivals per second."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    return np.cumsum(gaps) - gaps[0]
