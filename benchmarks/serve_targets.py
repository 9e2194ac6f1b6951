"""Issue 64's targets for `etjax serve`, measured side by side in one run (SmolLM2-135M).

`benchmarks/serve_load.py --targets` runs this. The servers are `etjax serve` subprocesses on
free loopback ports; this process is their client (asyncio, httpx2) and runs `decode()`'s
engine itself for the comparisons, never while a server works.

(a) **Server overhead.** 16 prompts, greedy, 64 new tokens each (end of sequence ignored, so
    both sides do the same work): one `decode()` call against 16 concurrent streamed HTTP
    completions to a server with decode()'s engine settings (configs/default.toml: FCFS,
    batch 32, 8 steps a burst, and a pool of 256 pages as decode() sizes one for this work).
    Output tokens per second over the wall time of the call, or from the first request sent
    to the last stream's end. The texts must be equal. Target: HTTP >= 0.95x decode().
(b) **Time to first token, cached prompt, idle server.** One short prompt, sent once to fill
    the prefix cache, then alone and timed: from the request sent to the first streamed chunk
    that carries text (the response's headers, sent once the engine took the request, come
    earlier: reported apart). Against it, the time to first token the engine reports
    (`time_to_first_token`) for the same prompt, cached, through an engine built as decode()
    builds one (the prompt run once on it first); decode()'s own first token on a fresh
    engine (prompt not cached) is reported beside it. 4 x `--repetitions` timed calls of
    each, the three interleaved (order alternating), each after IDLE_SECONDS of quiet.
    Target: <= 1.2x.
(c) **`online` through the server.** The `mixed` workload's first `--online-requests`
    requests (a quarter of them 2K-6K-token documents, 64-256 new tokens, T = 0.7 from the
    configs, a seed each) sent as Poisson arrivals at 80% of the capacity the FCFS server
    showed on the same requests sent at once, to two servers: configs/baseline.toml (FCFS)
    and configs/scheduling_only.toml (the entropic policy; otherwise equal), each with a pool
    of 2,048 pages. Each server first serves the requests at once, not timed (its programs
    compile there), then the FCFS server serves them at once again, warm: the capacity
    probe. Then `--online-repetitions` repetitions, each with its own arrival draw served by
    both servers one after the other (order alternating). Latency: request sent to stream
    end, per request; a run's mean and p99. Targets: entropic / FCFS mean <= 0.80x, p99
    <= 0.90x (the median of the repetitions' ratios).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx2
import numpy as np

START_SECONDS = 900  # loading and warming up a server on a busy 2-core machine
THROUGHPUT_ROWS, THROUGHPUT_TOKENS = 16, 64
TTFT_TOKENS = 16
IDLE_SECONDS = 0.25  # before each timed first-token call
SMALL_POOL, ONLINE_POOL = 256, 2048  # pages
LOAD = 0.8
CACHED_PROMPT = "What is the capital of Japan, and what is it known for?"
TOPICS = (
    "why the sky is blue",
    "how a bicycle works",
    "why cats purr",
    "how bread rises",
    "what a black hole is",
    "how vaccines work",
    "why the sea is salty",
    "how a rainbow forms",
)


def throughput_prompts() -> list[str]:
    """16 distinct prompts (no two share a first KV page)."""
    forms = ("Explain {} in two sentences.", "Tell a ten-year-old {}.")
    return [form.format(topic) for form in forms for topic in TOPICS]


# Servers -------------------------------------------------------------------------------------


@dataclass
class Served:
    """An `etjax serve` subprocess and its base URL."""

    name: str
    process: subprocess.Popen
    url: str = ""
    log: list[str] = field(default_factory=list)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def config_text(name: str, pages: int) -> str:
    """Config NAME (etjax/configs) with its pool fixed to `pages` pages."""
    from etjax.run_config import CONFIG_DIR

    text = (CONFIG_DIR / f"{name}.toml").read_text()
    assert text.count("[engine]\n") == 1, name
    return text.replace("[engine]\n", f"[engine]\nnum_pages = {pages}\n")


def start_server(name: str, config: str, folder: Path) -> Served:
    """Start `etjax serve` with `config` (TOML text); returns once it listens (not ready)."""
    path = folder / f"{name}.toml"
    path.write_text(config)
    command = [sys.executable, "-m", "etjax.cli", "serve", "--port", "0", "--config", str(path)]
    command += ["--max-waiting", "1024", "--request-timeout", "3600"]
    process = subprocess.Popen(
        command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True
    )
    served = Served(name, process)
    listening = threading.Event()

    def read() -> None:
        for line in process.stderr:
            served.log.append(line)
            if (found := re.search(r"listening on (http://\S+)", line)) is not None:
                served.url = found.group(1)
                listening.set()

    threading.Thread(target=read, daemon=True).start()
    if not listening.wait(120):
        served.stop()
        raise RuntimeError(f"{name}: the server did not listen:\n{''.join(served.log)}")
    return served


def wait_ready(served: Served) -> None:
    deadline = time.monotonic() + START_SECONDS
    while True:
        with contextlib.suppress(httpx2.HTTPError):
            if httpx2.get(f"{served.url}/health", timeout=10).status_code == 200:
                return
        if served.process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{served.name} never got ready:\n{''.join(served.log)}")
        time.sleep(1.0)


# The client -----------------------------------------------------------------------------------


@dataclass
class Answer:
    """One streamed completion as the client saw it (seconds from its send)."""

    status: int = 0
    headers: float | None = None  # the response's headers arrived
    ttft: float | None = None  # the first chunk with text
    e2e: float = 0.0
    text: str = ""
    tokens: int = 0
    error: str = ""


async def stream(client: httpx2.AsyncClient, body: dict) -> Answer:
    """POST a streamed completion and read it to its end."""
    body = body | {"stream": True, "stream_options": {"include_usage": True}}
    answer, start = Answer(), time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body) as response:
        answer.status, answer.headers = response.status_code, time.perf_counter() - start
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                answer.error = event["error"]["message"]
            if event.get("usage"):
                answer.tokens = event["usage"]["completion_tokens"]
            for choice in event.get("choices", []):
                if choice.get("text") and answer.ttft is None:
                    answer.ttft = time.perf_counter() - start
                answer.text += choice.get("text") or ""
    answer.e2e = time.perf_counter() - start
    if answer.status != 200 and not answer.error:
        answer.error = f"status {answer.status}"
    return answer


async def send_all(url: str, bodies: list[dict], arrivals: list[float]) -> tuple[list, float]:
    """Send body i at `arrivals[i]` seconds; the answers and the wall time to the last end."""
    limits = httpx2.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx2.Timeout(3600.0)
    async with httpx2.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        start = time.perf_counter()

        async def one(body: dict, at: float) -> Answer:
            await asyncio.sleep(max(at - (time.perf_counter() - start), 0.0))
            return await stream(client, body)

        answers = await asyncio.gather(*(one(b, a) for b, a in zip(bodies, arrivals, strict=True)))
        return list(answers), time.perf_counter() - start


def _checked(name: str, answers: list[Answer]) -> list[Answer]:
    failed = [a.error for a in answers if a.error]
    if failed:
        raise RuntimeError(f"{name}: {len(failed)} requests failed, e.g. {failed[0]}")
    return answers


# (a) server overhead ---------------------------------------------------------------------------


def measure_overhead(model, served: Served, repetitions: int, log) -> dict:
    import etjax

    prompts = throughput_prompts()
    bodies = [
        {"prompt": p, "max_tokens": THROUGHPUT_TOKENS, "ignore_eos": True, "temperature": 0.0}
        for p in prompts
    ]

    def via_decode() -> tuple[float, list[str]]:
        started = time.perf_counter()
        results = etjax.decode(
            prompts, model=model, max_new_tokens=THROUGHPUT_TOKENS, ignore_eos=True
        )
        elapsed = time.perf_counter() - started
        return sum(len(r.token_ids) for r in results) / elapsed, [r.text for r in results]

    rounds: list[dict] = []  # the server's rounds in each timed HTTP run

    def via_http() -> tuple[float, list[str]]:
        before = _server_means(served)["step_mean_s"]
        answers, wall = asyncio.run(send_all(served.url, bodies, [0.0] * len(bodies)))
        after = _server_means(served)["step_mean_s"]
        rounds.append(
            {"rounds": after[1] - before[1], "round_s": after[0] - before[0], "wall_s": wall}
        )
        answers = _checked("overhead", answers)
        return sum(a.tokens for a in answers) / wall, [a.text for a in answers]

    ways = {"decode": via_decode, "http": via_http}
    texts = {name: way()[1] for name, way in ways.items()}  # warm-up
    rates: dict[str, list[float]] = {name: [] for name in ways}
    for rep in range(repetitions):
        for name in ways if rep % 2 == 0 else reversed(ways):
            rate, got = ways[name]()
            rates[name].append(rate)
            texts[name] = got
        log(f"overhead {rep + 1}: " + ", ".join(f"{k} {v[-1]:.1f} tok/s" for k, v in rates.items()))
    ratios = [h / d for h, d in zip(rates["http"], rates["decode"], strict=True)]
    return {
        "decode_tokens_per_s": rates["decode"],
        "http_tokens_per_s": rates["http"],
        "ratios": ratios,
        "same_texts": texts["http"] == texts["decode"],
        "server_rounds": rounds[1:],  # the warm-up's left out
    }


# (b) time to first token -----------------------------------------------------------------------


def measure_first_token(model, served: Served, repetitions: int, log) -> dict:
    from etjax.engine_build import build_engine, generate_ids
    from etjax.runtime.options import RequestSettings, RuntimeOptions

    ids = model.tokenizer.encode(CACHED_PROMPT)
    settings = RequestSettings(max_new_tokens=TTFT_TOKENS, ignore_eos=True)
    # decode()'s defaults, with the model's entropy calibration as decode() and the server
    # apply it
    options = dataclasses.replace(RuntimeOptions(), calibration=model.calibration)
    engine = build_engine(model.weights, model.config, model.tokenizer, options, SMALL_POOL)
    body = {"prompt": CACHED_PROMPT, "max_tokens": TTFT_TOKENS, "ignore_eos": True}
    body["temperature"] = 0.0

    def engine_cached() -> float:
        (out,) = engine.generate([ids], [settings])
        return out.metrics["time_to_first_token"]

    def engine_fresh() -> float:  # decode()'s path: a new engine, nothing cached
        (out,) = generate_ids(model.weights, model.config, model.tokenizer, [ids], [settings])
        return out.metrics["time_to_first_token"]

    def http() -> tuple[float, float]:
        (answer,), _ = asyncio.run(send_all(served.url, [body], [0.0]))
        _checked("first token", [answer])
        return answer.ttft, answer.headers

    engine_cached(), engine_fresh(), http()  # warm-up; the prompt is cached from here on
    before = _server_means(served)
    found: dict[str, list[float]] = {"engine": [], "fresh": [], "http": [], "headers": []}

    def timed_http() -> float:
        ttft, headers = http()
        found["headers"].append(headers)
        return ttft

    ways = {"engine": engine_cached, "http": timed_http, "fresh": engine_fresh}
    for rep in range(repetitions):
        for name in ways if rep % 2 == 0 else reversed(ways):
            # Idle before each call: XLA's threads in the other process may still spin from
            # its last call, and the two processes share the cores.
            time.sleep(IDLE_SECONDS)
            found[name].append(ways[name]())
    log(
        "first token: "
        + ", ".join(f"{k} {statistics.median(v) * 1e3:.0f} ms" for k, v in found.items())
    )
    found["ratio"] = statistics.median(found["http"]) / statistics.median(found["engine"])
    after = _server_means(served)
    # The server's own view of the timed requests: from the request's queueing to its first
    # tokens handed to the event loop, and its rounds (a prefill step, then a burst).
    found["server_metrics"] = {
        name: (after[name][0] - before[name][0]) / max(after[name][1] - before[name][1], 1)
        for name in after
    }
    return found


def _server_means(served: Served) -> dict[str, tuple[float, float]]:
    # (sum, count) of the server's time-to-first-token and round histograms.
    text = httpx2.get(f"{served.url}/metrics", timeout=10).text
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line[:1] != "#")
    return {
        name: (float(values[f"etjax_{metric}_sum"]), float(values[f"etjax_{metric}_count"]))
        for name, metric in (
            ("ttft_mean_s", "time_to_first_token_seconds"),
            ("step_mean_s", "step_seconds"),
        )
    }


# (c) online ------------------------------------------------------------------------------------


def measure_online(model, servers: dict[str, Served], n: int, repetitions: int, seed, log):
    from etjax.bench.corpus import lee_articles
    from etjax.bench.workloads import mixed, poisson_arrivals

    workload = mixed(model.tokenizer, lee_articles(), n, seed=seed)
    bodies = [
        {"prompt": r.prompt, "max_tokens": r.max_new_tokens, "seed": seed * 1000 + i}
        for i, r in enumerate(workload)
    ]
    at_once = {}
    for name, served in servers.items():  # warm-up: compiles what these shapes need
        answers, wall = asyncio.run(send_all(served.url, bodies, [0.0] * n))
        at_once[name] = {"makespan_s": wall, **_latencies(_checked(name, answers))}
        log(f"online at once, warm-up ({name}): {wall:.1f} s")
    # The capacity probe: the requests at once again, warm.
    answers, wall = asyncio.run(send_all(servers["fcfs"].url, bodies, [0.0] * n))
    at_once["fcfs_warm"] = {"makespan_s": wall, **_latencies(_checked("fcfs", answers))}
    log(f"online at once, capacity (fcfs): {wall:.1f} s")
    capacity = n / wall
    rate = LOAD * capacity
    runs: dict[str, list[dict]] = {name: [] for name in servers}
    for rep in range(repetitions):
        arrivals = poisson_arrivals(n, rate, seed=seed + 1 + rep).tolist()
        order = list(servers) if rep % 2 == 0 else list(servers)[::-1]
        for name in order:
            answers, wall = asyncio.run(send_all(servers[name].url, bodies, arrivals))
            run = {"makespan_s": wall, **_latencies(_checked(name, answers))}
            runs[name].append(run)
            log(f"online {rep + 1} ({name}): mean {run['mean_s']:.1f} s, p99 {run['p99_s']:.1f} s")
    kinds = {}
    for r in workload:
        kinds[r.kind] = kinds.get(r.kind, 0) + 1
    return {
        "requests": n,
        "kinds": kinds,
        "capacity_requests_per_s": capacity,
        "rate_requests_per_s": rate,
        "at_once": at_once,
        "runs": runs,
        "mean_ratios": _ratios(runs, "mean_s"),
        "p99_ratios": _ratios(runs, "p99_s"),
        "ttft_ratios": _ratios(runs, "ttft_mean_s"),
    }


def _latencies(answers: list[Answer]) -> dict:
    e2e = [a.e2e for a in answers]
    return {
        "mean_s": float(np.mean(e2e)),
        "p50_s": float(np.percentile(e2e, 50)),
        "p99_s": float(np.percentile(e2e, 99)),
        "ttft_mean_s": float(np.mean([a.ttft for a in answers if a.ttft is not None])),
        "tokens": sum(a.tokens for a in answers),
        "latencies_s": e2e,
    }


def _ratios(runs: dict[str, list[dict]], key: str) -> list[float]:
    return [e[key] / f[key] for e, f in zip(runs["entropic"], runs["fcfs"], strict=True)]


# The run ---------------------------------------------------------------------------------------


def run_targets(args) -> int:
    """Measure (a), (b) and (c); print the section and write it to docs/PERF.md unless
    `args.no_write`."""
    import etjax
    from benchmarks.perf_report import machine_line, write_section

    def log(line: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {line}", flush=True)

    started, load_before = time.perf_counter(), os.getloadavg()[1]
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        servers = {
            "default": start_server("default", config_text("default", SMALL_POOL), folder),
            "fcfs": start_server("fcfs", config_text("baseline", ONLINE_POOL), folder),
            "entropic": start_server(
                "entropic", config_text("scheduling_only", ONLINE_POOL), folder
            ),
        }
        try:
            model = etjax.load_model()
            for served in servers.values():
                wait_ready(served)
            log("servers ready")
            overhead = measure_overhead(model, servers["default"], args.repetitions, log)
            first = measure_first_token(model, servers["default"], 4 * args.repetitions, log)
            servers.pop("default").stop()
            online = measure_online(
                model, servers, args.online_requests, args.online_repetitions, args.seed, log
            )
        finally:
            for served in servers.values():
                served.stop()
    raw = {
        "machine": machine_line(),
        "cpu": cpu_generation(),
        "weights": model.weights_format,  # load_model's default ("auto"), as the servers load
        "date": str(datetime.date.today()),
        "command": shlex.join(sys.argv[1:]),
        "seconds": time.perf_counter() - started,
        # 5-minute load averages before and after: other processes on the machine
        "load_average": [load_before, os.getloadavg()[1]],
        "overhead": overhead,
        "first_token": first,
        "online": online,
    }
    markdown = markdown_section(raw)
    print(markdown)
    if not args.no_write:
        write_section("serve", markdown, raw)
    return 0


def _spread(values: list[float], scale: float = 1.0, digits: int = 1) -> str:
    values = [v * scale for v in values]
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    low, mid, high = min(values), statistics.median(values), max(values)
    return f"{mid:.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"


def cpu_generation() -> str:
    """The CPU's family and model from /proc/cpuinfo, with AMD's generation where known
    (`machine_line` names an EPYC only "AMD EPYC")."""
    try:
        info = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        return ""
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    family, model = fields.get("cpu family", "?"), fields.get("model", "?")
    zen = {("25", m): "Zen 4" for m in ("16", "17", "24", "97")} | {("25", "1"): "Zen 3"}
    name = zen.get((family, model), "")
    return f"{name + ', ' if name else ''}family {family} model {model}"


def _rounds(overhead: dict) -> str:
    runs = overhead.get("server_rounds")
    if not runs:
        return ""
    return "; the server's rounds per run " + ", ".join(
        f"{r['rounds']:.0f} ({r['round_s']:.1f} s of the {r['wall_s']:.1f} s)" for r in runs
    )


def _capacity_run(at_once: dict) -> str:
    if "fcfs_warm" in at_once:
        return f"{at_once['fcfs_warm']['makespan_s']:.1f} s warm"
    # Runs before 2026-12-07 took the warm-up's makespan, compilation included.
    return f"{at_once['fcfs']['makespan_s']:.1f} s, its warm-up: compilation included"


def _titled_cpu(raw: dict) -> str:
    # "AMD EPYC (AVX2, AVX-512)" with its generation: "AMD EPYC Zen 4 (AVX2, AVX-512)".
    from etjax.bench.perf_doc import cpu_name

    name, generation = cpu_name(raw["machine"]), raw.get("cpu", "").split(",")[0]
    if not generation.startswith("Zen"):
        return name
    model, _, extensions = name.partition(" (")
    return f"{model} {generation}" + (f" ({extensions}" if extensions else "")


def _runs(n: int) -> str:
    return f"{n} timed run{'s' if n > 1 else ''}"


def _load(raw: dict) -> str:
    before, after = raw["load_average"]
    cores = os.cpu_count() or 1
    line = f"5-minute load average {before:.1f} before the run, {after:.1f} after ({cores} cores)"
    # The run keeps every core busy itself (servers, client, decode()): only a load above
    # that says other processes took their share.
    if max(before, after) > cores + 0.5:
        return (
            line
            + ": **measured while other processes loaded the machine** (absolute "
            + ("figures are slow and noisy; the ratios, side by side in one run, are what counts).")
        )
    return line + "."


def markdown_section(raw: dict) -> str:
    """The "serve" section of docs/PERF.md from a run's raw figures."""
    o, f, c = raw["overhead"], raw["first_token"], raw["online"]
    reps = len(o["ratios"])
    fcfs, ent = c["runs"]["fcfs"], c["runs"]["entropic"]

    def met(value: float, bound: float, above: bool = False) -> str:
        return "met" if (value >= bound if above else value <= bound) else "**missed**"

    ratio_a = statistics.median(o["ratios"])
    mean_c, p99_c = statistics.median(c["mean_ratios"]), statistics.median(c["p99_ratios"])
    lines = [
        f"## `etjax serve` against decode(): overhead, first token, `online` "
        f"(SmolLM2-135M-Instruct, weights {raw.get('weights', 'float32')}, {_titled_cpu(raw)})",
        "",
        f"Measured {raw['date']} on {raw['machine']}; the CPU: {raw.get('cpu', '?')}. Command: "
        "`.venv/bin/python "
        f"benchmarks/serve_load.py {raw['command']}` ({raw['seconds'] / 60:.0f} min; how each "
        "figure is taken: benchmarks/serve_targets.py). Servers are `etjax serve` "
        "subprocesses on loopback, the client and decode() this process, never at the same "
        "time. Median (min-max) over the timed repetitions, warm-ups excluded. " + _load(raw),
        "",
        "| target | decode() / FCFS | server / entropic | ratio | target | |",
        "|---|---|---|---|---|---|",
        f"| (a) greedy tok/s, 16 concurrent, 64 tokens each ({_runs(reps)}) | "
        f"{_spread(o['decode_tokens_per_s'])} | {_spread(o['http_tokens_per_s'])} | "
        f"{ratio_a:.2f}x | >= 0.95x | {met(ratio_a, 0.95, above=True)} |",
        f"| (b) first token, cached prompt, idle, ms ({_runs(len(f['http']))}) | "
        f"{_spread(f['engine'], 1e3, 0)} | {_spread(f['http'], 1e3, 0)} | "
        f"{f['ratio']:.2f}x | <= 1.2x | {met(f['ratio'], 1.2)} |",
        f"| (c) `online` mean latency, s ({_runs(len(fcfs))}) | "
        f"{_spread([r['mean_s'] for r in fcfs])} | {_spread([r['mean_s'] for r in ent])} | "
        f"{mean_c:.2f}x | <= 0.80x | {met(mean_c, 0.80)} |",
        f"| (c) `online` p99 latency, s | {_spread([r['p99_s'] for r in fcfs])} | "
        f"{_spread([r['p99_s'] for r in ent])} | {p99_c:.2f}x | <= 0.90x | "
        f"{met(p99_c, 0.90)} |",
        "",
        f"- (a): texts through HTTP equal decode()'s: {'yes' if o['same_texts'] else 'NO'}; "
        "paired ratios " + ", ".join(f"{r:.2f}" for r in o["ratios"]) + _rounds(o) + ".",
        f"- (b): the response's headers after {_spread(f['headers'], 1e3, 0)} ms; decode() "
        f"on a fresh engine (prompt not cached) {_spread(f['fresh'], 1e3, 0)} ms; the "
        "server's own mean time to first token "
        f"{f['server_metrics']['ttft_mean_s'] * 1e3:.0f} ms (from the request's queueing to "
        "its first tokens handed to the event loop), its mean round "
        f"{f['server_metrics']['step_mean_s'] * 1e3:.0f} ms.",
        f"- (c): {c['requests']} requests ("
        + ", ".join(f"{n} {k}" for k, n in sorted(c["kinds"].items()))
        + f"); capacity {c['capacity_requests_per_s']:.3f} requests/s (FCFS at once: "
        f"{_capacity_run(c['at_once'])}), arrivals at "
        f"{c['rate_requests_per_s']:.3f}/s; time to first token entropic / FCFS "
        + ", ".join(f"{r:.2f}" for r in c["ttft_ratios"])
        + "; makespans FCFS "
        + ", ".join(f"{r['makespan_s']:.0f}" for r in fcfs)
        + " s, entropic "
        + ", ".join(f"{r['makespan_s']:.0f}" for r in ent)
        + " s.",
    ]
    return "\n".join(lines)
