"""Load an `etjax serve` server through HTTP and report what its clients see.

    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --rate 2 --duration 60
    python benchmarks/serve_load.py --concurrency 8 --requests 64 --max-tokens 64

Requests are streamed completions (`--chat`: chat completions) of prompts drawn from a small
fixed list, sent either as a Poisson process at `--rate` requests per second or by
`--concurrency` clients that each send their next request when the last one ends. Arrivals
stop after `--duration` seconds or `--requests` requests, whichever comes first; requests in
flight then finish. Reported: throughput (requests and output tokens per second), time to
first token, inter-token latency (a request's time after its first token over its other
tokens) and end-to-end latency, each as p50 and p99, and the errors by status. `--output`
also writes them as JSON.

The load goes to loopback addresses only unless `--allow-remote` is given: a load test is
aimed at a server you run, on purpose.

`--targets` measures issue 64's targets instead, starting its own servers (`etjax serve`
subprocesses on free loopback ports, SmolLM2) and writing the "serve" section of
docs/PERF.md (benchmarks/serve_targets.py says how each figure is taken):

    .venv/bin/python benchmarks/serve_load.py --targets            # about 10 minutes
    .venv/bin/python benchmarks/serve_load.py --targets --no-write --repetitions 1  # smoke
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx2
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROMPTS = [
    "Explain in two sentences why the sky is blue.",
    "Write a short poem about the sea.",
    "List three uses of a paperclip.",
    "What is the capital of Japan, and what is it known for?",
    "Describe how a bicycle works.",
    "Give me a recipe for pancakes.",
    "Why do cats purr?",
    "Summarize the plot of a detective story in three sentences.",
]


@dataclass
class Outcome:
    """One request as its client saw it (times in seconds from its start)."""

    status: int = 0
    ttft: float | None = None
    e2e: float = 0.0
    tokens: int = 0
    error: str = ""


@dataclass
class Run:
    outcomes: list[Outcome] = field(default_factory=list)
    started: float = 0.0
    ended: float = 0.0


async def one_request(client: httpx2.AsyncClient, args: argparse.Namespace, prompt: str) -> Outcome:
    """Send one streamed request; time its first token and its end."""
    path = "/v1/chat/completions" if args.chat else "/v1/completions"
    body: dict = {
        "max_tokens": args.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": args.temperature,
    }
    body |= {"messages": [{"role": "user", "content": prompt}]} if args.chat else {"prompt": prompt}
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    outcome, start = Outcome(), time.perf_counter()
    try:
        async with client.stream("POST", path, json=body, headers=headers) as response:
            outcome.status = response.status_code
            if response.status_code != 200:
                outcome.error = (await response.aread()).decode("utf-8", "replace")[:200]
                return outcome
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    outcome.error = event["error"]["message"]
                    outcome.status = 500
                    break
                if event.get("usage"):
                    outcome.tokens = event["usage"]["completion_tokens"]
                if outcome.ttft is None and _has_text(event):
                    outcome.ttft = time.perf_counter() - start
    except httpx2.HTTPError as e:
        outcome.error = f"{type(e).__name__}: {e}"
    outcome.e2e = time.perf_counter() - start
    return outcome


def _has_text(event: dict) -> bool:
    for choice in event.get("choices", []):
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
    return False


async def run_load(args: argparse.Namespace) -> Run:
    """Arrivals as asked, until the duration or the request count runs out."""
    rng = random.Random(args.seed)
    run = Run(started=time.perf_counter())
    deadline = run.started + args.duration
    limits = httpx2.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx2.AsyncClient(base_url=args.url, timeout=args.timeout, limits=limits) as client:

        async def send() -> None:
            run.outcomes.append(await one_request(client, args, rng.choice(PROMPTS)))

        sent = 0
        if args.concurrency:

            async def worker() -> None:
                nonlocal sent
                while sent < args.requests and time.perf_counter() < deadline:
                    sent += 1
                    await send()

            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        else:
            tasks = []
            while sent < args.requests and time.perf_counter() < deadline:
                tasks.append(asyncio.create_task(send()))
                sent += 1
                await asyncio.sleep(rng.expovariate(args.rate))
            await asyncio.gather(*tasks)
    run.ended = time.perf_counter()
    return run


def summarize(run: Run) -> dict:
    """Throughput and latency percentiles of the requests that succeeded."""
    ok = [o for o in run.outcomes if o.status == 200 and not o.error]
    wall = run.ended - run.started

    def percentiles(values: list[float]) -> dict:
        if not values:
            return {"p50": None, "p99": None}
        return {"p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99))}

    inter_token = [
        (o.e2e - o.ttft) / (o.tokens - 1) for o in ok if o.ttft is not None and o.tokens > 1
    ]
    tokens = sum(o.tokens for o in ok)
    return {
        "requests": len(run.outcomes),
        "succeeded": len(ok),
        "errors": dict(Counter(o.status for o in run.outcomes if o not in ok)),
        "wall_seconds": wall,
        "requests_per_second": len(ok) / wall if wall else 0.0,
        "output_tokens_per_second": tokens / wall if wall else 0.0,
        "ttft_seconds": percentiles([o.ttft for o in ok if o.ttft is not None]),
        "inter_token_seconds": percentiles(inter_token),
        "e2e_seconds": percentiles([o.e2e for o in ok]),
    }


def _check_target(url: str, allow_remote: bool) -> None:
    host = urlparse(url).hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and not allow_remote:
        sys.exit(f"serve_load: {url} is not a loopback address; pass --allow-remote to load it")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=None)
    arrivals = parser.add_mutually_exclusive_group()
    arrivals.add_argument("--rate", type=float, default=1.0, help="Poisson arrivals per second")
    arrivals.add_argument("--concurrency", type=int, default=0, help="clients in a closed loop")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals")
    parser.add_argument("--requests", type=int, default=1000, help="requests at most")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--chat", action="store_true", help="chat completions")
    parser.add_argument("--seed", type=int, default=0, help="of the arrivals and prompts")
    parser.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    parser.add_argument("--output", type=Path, default=None, help="also write the summary here")
    parser.add_argument("--allow-remote", action="store_true")
    parser.add_argument("--targets", action="store_true", help="measure issue 64's targets")
    parser.add_argument("--repetitions", type=int, default=3, help="--targets: (a)'s timed runs")
    parser.add_argument("--online-repetitions", type=int, default=2, help="--targets: (c)'s")
    parser.add_argument("--online-requests", type=int, default=12, help="--targets: of `mixed`")
    parser.add_argument("--no-write", action="store_true", help="--targets: print only")
    args = parser.parse_args(argv)
    if args.targets:
        from benchmarks.serve_targets import run_targets

        return run_targets(args)
    _check_target(args.url, args.allow_remote)
    summary = summarize(asyncio.run(run_load(args)))
    text = json.dumps(summary, indent=2)
    print(text)
    if args.output is not None:
        args.output.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
