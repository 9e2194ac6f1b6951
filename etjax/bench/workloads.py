"""Seeded workloads built from the gensim Lee corpus (300 news articles).

`mixed(n, seed)`: three quarters short requests (the opening of one article with an
instruction to summarise, continue, or answer a question about it) and one quarter long
documents (consecutive articles joined to 2K-6K tokens, to be summarised), each with 64-256
new tokens drawn uniformly. `shared(n, seed)`: requests whose prompts start alike, where
prefix caching pays: documents of 1.5K-3K tokens each asked four questions, short tasks
behind one long instruction block (few-shot examples), and prompts sampled four times (as
`n=4` would), with 32-96 new tokens. `long(n, seed, context)`: decode-bound requests,
documents of 4K-16K tokens (up to the model's context) each asked three questions or asked to
continue, with 256-1,024 new tokens, so that the decode phase over long KV caches, where
pruning and the scheduler act, is most of the run once the documents' pages are shared.
`long_output(n, seed, context)`: long generations from short prompts, the other decode-bound
case: an article's opening (64-384 tokens) to be continued or written up at length, with
1,024-4,096 new tokens (within the model's context), so each row's KV cache grows through the
run and the sampler's entropy, not the prompt, decides what the levels do.
`poisson_arrivals(n, rate, seed)`: arrival times (seconds) of a Poisson process of `rate`
requests per second. A workload file (etjax/bench/workload_file.py) holds anyone's own.
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
    kind: str  # mixed: "summarise" | "continue" | "question" | "long"; the others: see them
    prompt: str
    max_new_tokens: int
    # The prompt's token ids when they are not the plain encoding of `prompt` (a chat
    # conversation of a workload file); empty: encode `prompt`.
    prompt_ids: tuple[int, ...] = ()
    priority: float = 0.0
    arrival: float = 0.0  # seconds after the run starts (a workload file's own arrivals)

    def token_ids(self, tokenizer) -> list[int]:
        """What the engine and the reference run: `prompt_ids`, or `prompt` encoded."""
        return list(self.prompt_ids) if self.prompt_ids else tokenizer.encode(self.prompt)


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


QUESTIONS = (
    "Who is the main person or group in these reports?",
    "Where do the events take place?",
    "What happened first?",
    "What is expected to happen next?",
)


def shared(tokenizer, articles: list[str], n: int = 48, seed: int = 0) -> list[WorkloadRequest]:
    """The `shared` workload (see the module docstring), deterministic in `seed`: groups of
    four requests in turn, a document's questions, instruction-block tasks, and one prompt's
    four samples."""
    rng = random.Random(seed)
    # The instruction block: the same for every task of the workload, about 600 tokens of
    # worked examples.
    examples = [
        f"Article: {tokenizer.decode(tokenizer.encode(articles[i])[:120])}\nTopic: "
        f"{rng.choice(('politics', 'sport', 'business', 'weather', 'crime'))}"
        for i in range(4)
    ]
    block = "Name the topic of each article in one word.\n\n" + "\n\n".join(examples)
    requests: list[WorkloadRequest] = []
    group = 0
    while len(requests) < n:
        kind = ("document", "instruction", "samples")[group % 3]
        group += 1
        if kind == "document":
            target, start = rng.randint(1536, 3072), rng.randrange(len(articles))
            ids: list[int] = []
            for k in range(start, start + len(articles)):
                ids += tokenizer.encode(articles[k % len(articles)] + "\n\n")
                if len(ids) >= target:
                    break
            document = tokenizer.decode(ids[:target])
            prompts = [f"{document}\nQuestion: {q}\nAnswer:" for q in QUESTIONS]
        elif kind == "instruction":
            picks = [rng.randrange(4, len(articles)) for _ in range(4)]
            prompts = [
                f"{block}\n\nArticle: "
                f"{tokenizer.decode(tokenizer.encode(articles[i])[: rng.randint(60, 160)])}\nTopic:"
                for i in picks
            ]
        else:
            article = articles[rng.randrange(len(articles))]
            text = tokenizer.decode(tokenizer.encode(article)[: rng.randint(200, 400)])
            prompts = [INSTRUCTIONS["summarise"].format(text=text)] * 4
        for prompt in prompts[: n - len(requests)]:
            requests.append(WorkloadRequest(kind, prompt, rng.randint(32, 96)))
    return requests


LONG_QUESTIONS = (
    "Summarise everything reported above, event by event.",
    "List every person and organisation mentioned above, with what each did.",
    "Write the follow-up report a news desk would file tomorrow.",
)


def long(
    tokenizer, articles: list[str], n: int = 16, seed: int = 0, context: int = 16384
) -> list[WorkloadRequest]:
    """The `long` workload (see the module docstring), deterministic in `seed`: groups of
    four requests on one document, three questions and a continuation; documents of 4K-16K
    tokens, fitted with their questions and outputs into `context` tokens."""
    rng = random.Random(seed)
    requests: list[WorkloadRequest] = []
    while len(requests) < n:
        new = [rng.randint(256, 1024) for _ in range(4)]
        longest = min(16384, context - max(new) - 64)  # room for a question and the output
        target = rng.randint(min(4096, longest), longest)
        start, ids = rng.randrange(len(articles)), []
        for k in range(start, start + len(articles)):
            ids += tokenizer.encode(articles[k % len(articles)] + "\n\n")
            if len(ids) >= target:
                break
        document = tokenizer.decode(ids[:target])
        prompts = [f"{document}\nTask: {q}\nAnswer:" for q in LONG_QUESTIONS] + [document]
        for kind, prompt, m in zip(("question",) * 3 + ("continue",), prompts, new, strict=True):
            if len(requests) < n:
                requests.append(WorkloadRequest(kind, prompt, m))
    return requests


LONG_OUTPUT_TASKS = (
    "Continue this news report for several pages, adding interviews and background.\n\n{text}",
    "Write a detailed feature story that follows up on this article.\n\n{text}\n\nStory:",
    "{text}",
)


def long_output(
    tokenizer, articles: list[str], n: int = 16, seed: int = 0, context: int = 16384
) -> list[WorkloadRequest]:
    """The `long_output` workload (see the module docstring), deterministic in `seed`."""
    rng = random.Random(seed)
    requests = []
    for _ in range(n):
        article = articles[rng.randrange(len(articles))]
        text = tokenizer.decode(tokenizer.encode(article)[: rng.randint(64, 384)])
        task = rng.randrange(len(LONG_OUTPUT_TASKS))
        prompt = LONG_OUTPUT_TASKS[task].format(text=text)
        room = context - len(tokenizer.encode(prompt)) - 1
        new = min(rng.randint(1024, 4096), room)
        requests.append(WorkloadRequest(("continue", "story", "open")[task], prompt, new))
    return requests


WORKLOADS = {
    "mixed": "the mixed requests, all submitted at once",
    "online": "the mixed requests with Poisson arrivals at a fraction of measured capacity",
    "shared": "requests with shared beginnings (documents asked several questions, one "
    "instruction block, repeated samples), all submitted at once",
    "long": "decode-bound requests on 4K-16K-token documents, 256-1,024 new tokens, all "
    "submitted at once",
    "long_output": "short prompts continued at length, 1,024-4,096 new tokens, all submitted "
    "at once",
}


def build_workload(
    name: str, tokenizer, articles: list[str], n: int, seed: int, context: int = 16384
) -> list[WorkloadRequest]:
    """The requests of built-in workload `name` (a key of WORKLOADS); `context`: the
    model's, which the `long` workload's documents fit in."""
    if name == "long":
        return long(tokenizer, articles, n, seed=seed, context=context)
    if name == "long_output":
        return long_output(tokenizer, articles, n, seed=seed, context=context)
    make = shared if name == "shared" else mixed
    return make(tokenizer, articles, n, seed=seed)


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> np.ndarray:
    """Arrival times [n] in seconds of a Poisson process with `rate` arrivals per second."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    return np.cumsum(gaps) - gaps[0]
