"""etjax beside llama.cpp on the same GGUF file and the same token ids, on this CPU.

The model is SmolLM2-135M-Instruct Q4_1 as shipped (`etjax.loaders.embedded`). llama.cpp is
node-llama-cpp's prebuilt CPU build (no compiler needed), installed from the npm registry into
the user's cache folder on first use and driven by `benchmarks/peer_llamacpp.mjs`: one
context with several sequences, batched into one llama_decode per step, `--threads` threads,
the weights as the file stores them. etjax runs `generate_ids` with the options `decode()`
gives it (the engine as a user meets it), its weights in each `--weights` format.

Every prompt is tokenized once, by etjax's tokenizer, and both engines get the same ids.
Measured, greedy with end-of-sequence ignored (a fixed token count):

- prefill of a 2,048-token document (the Lee corpus's articles joined): the time to the first
  token;
- greedy decode of 128 tokens after a 32-token prompt at batch 1 and batch 8 (end to end, the
  prompts' prefill included).

Each measurement is run once to warm up (etjax's first call, compilation included, is
reported apart), then `--repeats` times, engines alternating; tokens/s are median (min-max),
ratios of medians. Whether the engines' greedy tokens agree is reported, not asserted: float
rounding can move a near tie. The CPU time other processes took meanwhile is reported too.
Writes the "peer_llamacpp" section of docs/PERF.md.

    .venv/bin/python benchmarks/peer_llamacpp.py [--weights float32[,stored]] [--repeats 3]
        [--threads 2] [--no-write]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import inspect
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.perf_report import machine_line, median_spread, write_section
from etjax.errors import EtjaxError

SECTION = "peer_llamacpp"
DRIVER = Path(__file__).resolve().with_name("peer_llamacpp.mjs")
# The prebuilt llama.cpp, pinned: both packages at the same version.
NODE_LLAMA_CPP = "3.22.1"
PACKAGES = (f"node-llama-cpp@{NODE_LLAMA_CPP}", f"@node-llama-cpp/linux-x64@{NODE_LLAMA_CPP}")
DOCUMENT_TOKENS, PROMPT_TOKENS, NEW_TOKENS = 2048, 32, 128
LLAMACPP = "llama.cpp"
# The measurements, in table order: (key, row title).
ROWS = (
    ("prefill", f"prefill, {DOCUMENT_TOKENS:,}-token document"),
    ("decode_1", f"greedy decode, batch 1, {NEW_TOKENS} tokens"),
    ("decode_8", f"greedy decode, batch 8, {NEW_TOKENS} tokens"),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--weights",
        default="float32",
        help="etjax's weight formats, comma-separated, each a column (load_model's `weights`; "
        "float32 and bfloat16 are its dtype where it has no `weights` option)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    parser.add_argument(
        "--no-write",
        action="store_true",
        help="leave PERF.md; print the raw results (JSON) after the section",
    )
    args = parser.parse_args()
    formats = [w for w in args.weights.split(",") if w]

    from etjax.bench.corpus import lee_articles
    from etjax.loaders.embedded import smollm2_gguf_path

    path = smollm2_gguf_path()
    share = CpuShare()
    engines: dict[str, object] = {name: EtjaxEngine(path, name) for name in formats}
    tokenizer = next(iter(engines.values())).model.tokenizer
    work = workload(tokenizer, lee_articles())
    with LlamaCppDriver(driver_command(install_llamacpp(), path, args.threads)) as peer:
        engines[LLAMACPP] = peer
        rows = {key: measure(engines, key, work[key], args.repeats) for key, _ in ROWS}
    raw = {
        "machine": machine_line(),
        "date": str(datetime.date.today()),
        "command": f"benchmarks/peer_llamacpp.py {shlex.join(sys.argv[1:])}".strip(),
        "model": path.name,
        "weights": formats,
        "threads": args.threads,
        "llama_cpp": peer.info,
        "resident_weight_mb": {w: engines[w].weight_mb for w in formats},
        "other_cores": share.others(),
        "rows": rows,
    }
    markdown = report(raw)
    if not args.no_write:
        write_section(SECTION, markdown, raw)
    print(markdown)
    if args.no_write:  # what write_section would have kept in benchmarks/results
        print(json.dumps(raw))


def workload(tokenizer, articles: list[str]) -> dict[str, list[list[int]]]:
    """Each measurement's prompts as token ids, tokenized once by etjax's tokenizer."""
    document = tokenizer.encode(" ".join(articles))[:DOCUMENT_TOKENS]
    if len(document) < DOCUMENT_TOKENS:
        raise EtjaxError(f"the Lee corpus gave {len(document)} tokens; need {DOCUMENT_TOKENS}")
    prompts = [tokenizer.encode(article)[:PROMPT_TOKENS] for article in articles[:8]]
    return {"prefill": [document], "decode_1": prompts[:1], "decode_8": prompts}


def measure(engines: dict, key: str, prompts: list[list[int]], repeats: int) -> dict:
    """One measurement on every engine: a warm-up run each, then `repeats` rounds in turn.

    Returns {"tokens": counted per run, "first_call_s": {engine: s}, "seconds": {engine: [s]},
    "outputs": {engine: token ids per prompt}}.
    """
    new_tokens = 1 if key == "prefill" else NEW_TOKENS
    counted = len(prompts[0]) if key == "prefill" else len(prompts) * NEW_TOKENS
    first, seconds, outputs = {}, {name: [] for name in engines}, {}
    for name, engine in engines.items():
        first[name], outputs[name] = engine.generate(prompts, new_tokens)
    for _ in range(repeats):
        for name, engine in engines.items():
            elapsed, outputs[name] = engine.generate(prompts, new_tokens)
            seconds[name].append(elapsed)
    print(key, {name: statistics.median(s) for name, s in seconds.items()}, flush=True)
    return {"tokens": counted, "first_call_s": first, "seconds": seconds, "outputs": outputs}


class EtjaxEngine:
    """etjax on the GGUF file, its weights in one format, through the engine `decode()` runs."""

    def __init__(self, path: Path, weights: str) -> None:
        import jax

        import etjax

        self.model = etjax.load_model(path, **load_options(etjax.load_model, weights))
        leaves = jax.tree.leaves(self.model.weights)
        self.weight_mb = sum(leaf.nbytes for leaf in leaves) / 1e6

    def generate(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
        """(seconds, greedy token ids per prompt) of one call, eos ignored."""
        from etjax.engine_build import RequestSettings, generate_ids

        settings = [RequestSettings(max_new_tokens=new_tokens, ignore_eos=True)] * len(prompts)
        m = self.model
        started = time.perf_counter()
        # The options decode() gives the engine by default (RuntimeOptions()).
        outputs = generate_ids(m.weights, m.config, m.tokenizer, prompts, settings)
        return time.perf_counter() - started, [o.token_ids for o in outputs]


def load_options(load_model, weights: str) -> dict:
    """`load_model`'s keywords for a weight format: `weights=` where it takes that option;
    before it did, float32 and bfloat16 were its `dtype` and nothing else was on offer."""
    if "weights" in inspect.signature(load_model).parameters:
        return {"dtype": "float32", "weights": weights}
    if weights in ("float32", "bfloat16"):
        return {"dtype": weights}
    raise EtjaxError(
        f"--weights {weights!r}: this etjax's load_model has no `weights` option; "
        "allowed here: float32, bfloat16"
    )


def install_llamacpp(folder: Path | None = None) -> Path:
    """The folder holding node_modules/node-llama-cpp at the pinned version, installed from the
    npm registry if it is not there yet (the prebuilt binaries ship in the linux-x64 package;
    nothing is downloaded or built at install time)."""
    if folder is None:
        cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        folder = Path(cache) / "etjax" / "peer" / f"node-llama-cpp-{NODE_LLAMA_CPP}"
    installed = folder / "node_modules" / "node-llama-cpp" / "package.json"
    if installed.exists() and json.loads(installed.read_text())["version"] == NODE_LLAMA_CPP:
        return folder
    for tool in ("node", "npm"):
        if shutil.which(tool) is None:
            raise EtjaxError(f"{tool} is not on PATH; the llama.cpp peer runs under Node.js >= 20")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "package.json").write_text('{"private": true}\n')
    env = {**os.environ, "NODE_LLAMA_CPP_SKIP_DOWNLOAD": "true"}
    command = ["npm", "install", "--omit=optional", "--no-audit", "--no-fund", *PACKAGES]
    done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise EtjaxError(f"{shlex.join(command)} in {folder} failed:\n{done.stderr[-2000:]}")
    return folder


def driver_command(folder: Path, model: Path, threads: int) -> list[str]:
    """The Node driver's command line: one prefill sequence long enough for the document, eight
    decoding sequences."""
    prefill_context = DOCUMENT_TOKENS + 64
    return ["node", str(DRIVER), str(folder), str(model), str(threads), str(prefill_context), "8"]


def parse_reply(line: str, fields: tuple[str, ...]) -> dict:
    """One JSON line of the driver, with `fields`; an EtjaxError saying what came instead."""
    if not line:
        raise EtjaxError("the llama.cpp driver exited without replying (its stderr is above)")
    try:
        reply = json.loads(line)
    except json.JSONDecodeError as e:
        raise EtjaxError(
            f"the llama.cpp driver wrote {line[:200]!r}, not a JSON line ({e})"
        ) from None
    if not isinstance(reply, dict):
        raise EtjaxError(f"the llama.cpp driver wrote {line[:200]!r}; expected a JSON object")
    if "error" in reply:
        raise EtjaxError(f"the llama.cpp driver failed: {reply['error']}")
    missing = [name for name in fields if name not in reply]
    if missing:
        raise EtjaxError(f"the llama.cpp driver's reply {line[:200]!r} lacks {missing}")
    return reply


class LlamaCppDriver:
    """llama.cpp in a Node process speaking benchmarks/peer_llamacpp.mjs's line protocol."""

    def __init__(self, command: list[str]) -> None:
        # stderr passes through: llama.cpp's warnings, and a crash's trace, reach the console.
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        try:
            self.info = self._read(("ready", "llama_cpp", "cpu_variant", "system_info"))
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> LlamaCppDriver:
        return self

    def __exit__(self, *_) -> None:
        self.close()

    def close(self) -> None:
        """End the driver: its stdin closed, it exits when the last request is answered."""
        with contextlib.suppress(BrokenPipeError):  # it has gone already
            self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process.stdout.close()

    def _read(self, fields: tuple[str, ...]) -> dict:
        return parse_reply(self.process.stdout.readline(), fields)

    def _ask(self, request: dict, fields: tuple[str, ...]) -> dict:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self._read(fields)

    def generate(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
        """(seconds, greedy token ids per prompt), timed inside the driver; one new token is a
        prefill (the prompt evaluated, the first token drawn)."""
        if new_tokens == 1 and len(prompts) == 1:
            reply = self._ask({"op": "prefill", "tokens": prompts[0]}, ("seconds", "token"))
            return float(reply["seconds"]), [[int(reply["token"])]]
        request = {"op": "decode", "prompts": prompts, "new_tokens": new_tokens}
        reply = self._ask(request, ("seconds", "tokens"))
        return float(reply["seconds"]), [[int(t) for t in row] for row in reply["tokens"]]


@dataclass(frozen=True)
class Agreement:
    """How far two engines' greedy tokens agree, row by row."""

    rows: int  # prompts compared
    identical: int  # rows whose tokens are the same throughout
    shortest: int  # the shortest common prefix over the rows, in tokens
    length: int  # tokens per row

    def __str__(self) -> str:
        if self.rows == 1:
            return f"{self.shortest} of {self.length}"
        return f"{self.identical} of {self.rows} rows; shortest {self.shortest} of {self.length}"


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> Agreement:
    """The agreement of two lists of greedy token rows, compared position by position."""
    if len(ours) != len(theirs):
        raise EtjaxError(f"{len(ours)} rows against {len(theirs)}; compare the same prompts")
    prefixes = [common_prefix(a, b) for a, b in zip(ours, theirs, strict=True)]
    length = max((max(len(a), len(b)) for a, b in zip(ours, theirs, strict=True)), default=0)
    same = sum(a == b for a, b in zip(ours, theirs, strict=True))
    return Agreement(len(ours), same, min(prefixes, default=0), length)


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def rate(row: dict, engine: str) -> list[float]:
    """Tokens per second of each timed run of `engine` in a measurement."""
    return [row["tokens"] / s for s in row["seconds"][engine]]


def report(raw: dict) -> str:
    """The PERF.md section: the side-by-side table, then what each engine ran."""
    formats, info = raw["weights"], raw["llama_cpp"]
    head = ["measurement", *(f"etjax {w} tok/s" for w in formats), "llama.cpp tok/s"]
    head += [f"{w} / llama.cpp" for w in formats]
    head += [f"etjax {w} first call s" for w in formats]
    head += [f"greedy tokens agree ({w})" for w in formats]
    lines = [
        f"## etjax beside llama.cpp: {raw['model']}, same file, same token ids",
        "",
        f"Measured {raw['date']} on {raw['machine']}. Command: `.venv/bin/python "
        f"{raw['command']}`. " + load_note(raw["other_cores"]),
        "",
        "| " + " | ".join(head) + " |",
        "|---" * len(head) + "|",
    ]
    for key, title in ROWS:
        row = raw["rows"][key]
        peer = statistics.median(rate(row, LLAMACPP))
        cells = [title, *(median_spread(rate(row, w)) for w in formats)]
        cells.append(median_spread(rate(row, LLAMACPP)))
        cells += [f"{statistics.median(rate(row, w)) / peer:.2f}x" for w in formats]
        cells += [f"{row['first_call_s'][w]:.1f}" for w in formats]
        outputs = row["outputs"]
        cells += [str(agreement(outputs[w], outputs[LLAMACPP])) for w in formats]
        lines.append("| " + " | ".join(cells) + " |")
    release = info["llama_cpp"]
    resident = ", ".join(f"{w} {mb:.0f} MB" for w, mb in raw["resident_weight_mb"].items())
    lines += [
        "",
        f"- llama.cpp: {release['repo']} {release['release']}, node-llama-cpp "
        f"{info.get('node_llama_cpp', '?')} {info.get('build', '')} CPU build, CPU variant "
        f"{', '.join(info['cpu_variant']) or 'none found'}, {raw['threads']} threads, batch "
        f"size {info.get('batch_size', {}).get('prefill', '?')}, the weights as the file "
        f"stores them; ggml's system info: `{info['system_info'].strip(' |')}`.",
        f"- etjax: `generate_ids` with `decode()`'s default options, all cores; resident "
        f"weights {resident}. First call: the warm-up run, compilation (or loading from "
        "the persistent compilation cache) included; not in the tok/s.",
        f"- Prefill: the time to the first token of the document. Decode: {NEW_TOKENS} new "
        f"tokens after the first {PROMPT_TOKENS} tokens of Lee articles, prompt prefill "
        "included, eos ignored. Greedy tokens agree: the common prefix of the two engines' "
        "tokens (reported, not asserted: float rounding can turn a near tie).",
    ]
    return "\n".join(lines)


class CpuShare:
    """The CPU other processes used from its creation on: the machine's busy time (/proc/stat)
    less this process's and its waited children's."""

    def __init__(self) -> None:
        self.start = (time.perf_counter(), _machine_busy_s(), _own_busy_s())

    def others(self) -> float:
        """Cores other processes kept busy on average since the start (0 where /proc is not)."""
        wall, busy, own = self.start
        elapsed = time.perf_counter() - wall
        return max(0.0, (_machine_busy_s() - busy - (_own_busy_s() - own)) / elapsed)


def _machine_busy_s() -> float:
    # The first line of /proc/stat: jiffies in user, nice, system, idle, iowait, irq, softirq,
    # steal...; busy is all but idle and iowait.
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except OSError:
        return 0.0
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def _own_busy_s() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def load_note(other_cores: float) -> str:
    """Whether other work shared the machine while it ran, for the section's first lines."""
    text = f"Other processes kept {other_cores:.2f} of {os.cpu_count()} cores busy on average"
    if other_cores >= 0.2:
        return text + ": **measured under load**, the ratios less sure than alone."
    return text + " (the machine was otherwise quiet)."


if __name__ == "__main__":
    main()
