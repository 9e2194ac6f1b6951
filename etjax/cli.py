"""The `etjax` command line: `generate` streams a completion, `batch` runs a resumable JSONL job,
`bench` runs the ablation, `convert` saves a fast checkpoint, `serve` answers HTTP requests."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from etjax.calibrate.command import add_calibrate
from etjax.compilation_cache import use_persistent_cache
from etjax.errors import EtjaxError, JobInterrupted
from etjax.generate_command import add_generate
from etjax.model.quantized import WEIGHTS_CHOICES
from etjax.planning.command import add_plan
from etjax.serve.command import add_serve

log = logging.getLogger("etjax")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `etjax` console script; returns the process exit code."""
    use_persistent_cache()  # before anything compiles (the engine would do it later)
    parser = _parser()
    args = parser.parse_args(argv)
    _log_to_stderr(
        logging.DEBUG if args.verbose else logging.WARNING if args.quiet else logging.INFO
    )
    try:
        return args.run(args)
    except JobInterrupted as e:
        print(f"etjax: {e}", file=sys.stderr)
        return 128 + e.signal_number  # as the shell reports a process killed by the signal
    except EtjaxError as e:
        print(f"etjax: error: {e}", file=sys.stderr)
        return 2


def _log_to_stderr(level: int) -> None:
    # The CLI shows the `etjax` logger's diagnostics (loading, retries, progress in captured
    # output); a library leaves handlers to its caller.
    log = logging.getLogger("etjax")
    if not any(isinstance(h, _StderrHandler) for h in log.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("etjax: %(message)s"))
        log.addHandler(handler)
        log.propagate = False  # printed here once, not again by a handler some library put on root
    log.setLevel(level)


class _StderrHandler(logging.StreamHandler):
    # Writes to whatever sys.stderr is when a record comes (it may be replaced after setup).
    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def batch_formats() -> str:
    """The record and result formats `etjax batch --help` shows, the fields read from their
    tables (etjax/request_fields.py, `SamplerSettings`, the OpenAI body names)."""
    import textwrap

    from etjax.jobs.openai_format import body_fields
    from etjax.request_fields import RECORD, open_at

    optional = ", ".join(f'"{name}"' for name in open_at(RECORD))
    fields = (
        f'optional: {optional}, and any sampler field ("sampler", "temperature", "seed", '
        '"top_p", "top_k", ...); missing fields take the config\'s [request] and [sampler] '
        'defaults. Without an "id" a record is known by its line number. Without a "seed" it '
        "samples from a stream derived from the config's seed and its id."
    )
    body = f'("/v1/completions" takes "prompt"); body fields: {", ".join(body_fields())}, '
    body += "model (echoed)."
    fields, body = (textwrap.indent(textwrap.fill(t, 92), "  ") for t in (fields, body))
    return (
        "record (one JSON object per input line):\n"
        '  {"id": "q1", "prompt": "Explain entropy."}                      a string prompt\n'
        '  {"id": "q2", "messages": [{"role": "user", "content": "Hi"}]}    a conversation\n'
        f"{fields}\n\n"
        "OpenAI Batch API lines are read too, and answered in that format:\n"
        '  {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",\n'
        '   "body": {"messages": [...], "max_tokens": 64, "temperature": 0.7, "n": 2}}\n'
        f"{body}\n\n"
        "result (one JSON line per record, in completion order; --ordered: in input order):\n"
        '  {"id", "text", "token_ids", "finish_reason", "prompt_tokens", "metrics", "seed",\n'
        '   "error": null, "fingerprint"}, or {"id", "error": "line N: ...", "fingerprint"};\n'
        '  with "logprobs": k also "top_logprobs": per token k [token_id, logprob] pairs\n'
    )


def _parser() -> argparse.ArgumentParser:
    from etjax import __version__

    parser = argparse.ArgumentParser(prog="etjax", description=__doc__)
    parser.add_argument("--version", action="version", version=f"etjax {__version__}")
    loudness = parser.add_mutually_exclusive_group()
    loudness.add_argument("-v", "--verbose", action="store_true", help="also debug messages")
    loudness.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors")
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    add_generate(commands)

    batch = commands.add_parser(
        "batch",
        help="run a JSONL file of prompts; rerun the same command to resume",
        description="Run a JSONL file of requests into a JSONL file of results. Rerun the "
        "same command to resume: finished ids are skipped, error lines retried.",
        epilog=batch_formats(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    batch.add_argument("--input", type=Path, required=True, help="JSONL, one request per line")
    batch.add_argument("--output", type=Path, required=True, help="JSONL of results (appended)")
    batch.add_argument(
        "--config", default="default", help="a name in configs/ or the path of a .toml file"
    )
    batch.add_argument(
        "--model",
        default=None,
        help="overrides the config's model: a preset in configs/models/ (or a preset .toml), "
        "or a model name or path",
    )
    batch.add_argument(
        "--calibration",
        type=Path,
        default=None,
        help="a file written by `etjax calibrate`: pruning, the scheduler and drafting read the "
        "calibrated entropy (overrides the model preset's `calibration`)",
    )
    batch.add_argument(
        "--process-index",
        type=int,
        default=None,
        help="this process's shard of the input (env ETJAX_PROCESS_INDEX)",
    )
    batch.add_argument(
        "--process-count",
        type=int,
        default=None,
        help="how many processes share the input (env ETJAX_PROCESS_COUNT)",
    )
    batch.add_argument(
        "--coordinator",
        default=os.environ.get("ETJAX_COORDINATOR"),
        help="HOST:PORT of process 0, or 'auto' on a TPU pod slice / Slurm: join one job with "
        "jax.distributed; process 0 merges the shards (env ETJAX_COORDINATOR)",
    )
    batch.add_argument(
        "--timeout",
        type=int,
        default=600,
        help="seconds to wait for the other processes to join and to finish (with --coordinator)",
    )
    batch.add_argument(
        "--redo-changed",
        action="store_true",
        help="run again the records whose stored result came from a different prompt or "
        "settings (without it, such a rerun stops and names the first)",
    )
    batch.add_argument(
        "--merge",
        action="store_true",
        help="only merge the part files of --process-count processes into --output",
    )
    batch.add_argument(
        "--ordered",
        action="store_true",
        help="when the job is done, rewrite the results in input order (one process; several "
        "processes' merge is in input order anyway)",
    )
    batch.add_argument("--no-progress", action="store_true")
    batch.set_defaults(run=_batch)

    _add_bench(commands)
    add_calibrate(commands)
    add_serve(commands)
    add_plan(commands)

    conv = commands.add_parser("convert", help="convert a model to an etjax (orbax) checkpoint")
    conv.add_argument("source", help="a .gguf file, a Hugging Face directory or a model name")
    conv.add_argument("destination", type=Path, help="a new directory")
    conv.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    conv.add_argument(
        "--weights",
        default="auto",
        choices=WEIGHTS_CHOICES,
        help="how the saved matrices are held (int8: quantized once, so a load reads them "
        "as they are)",
    )
    conv.set_defaults(run=_convert)
    return parser


def _add_bench(commands) -> None:
    from etjax.bench.ablation import BenchPlan

    d = BenchPlan()
    bench = commands.add_parser(
        "bench", help="run named configs side by side on a workload: JSON, table and plots"
    )
    bench.add_argument(
        "--workload",
        default=d.workload,
        help="mixed, online, shared, long, long_output, or FILE.jsonl: records of your own "
        "(prompt or messages, max_new_tokens, priority, arrival in seconds)",
    )
    bench.add_argument(
        "--configs", default=",".join(d.configs), help="comma-separated; the first is the baseline"
    )
    bench.add_argument(
        "--model", default=None, help="a model preset in configs/models/ for every config"
    )
    bench.add_argument("--requests", type=int, default=d.requests)
    bench.add_argument("--repetitions", type=int, default=d.repetitions)
    bench.add_argument("--seed", type=int, default=d.seed, help="of the workload")
    bench.add_argument("--load", type=float, default=d.load, help="online: arrival rate / capacity")
    bench.add_argument(
        "--arrivals",
        action="store_true",
        help="Poisson arrivals at --load for a built-in workload other than online "
        "(online is mixed with them): --workload long --arrivals serves long documents live",
    )
    bench.add_argument(
        "--equal-length",
        action="store_true",
        help="every request generates exactly its max_new_tokens (no EOS): equal work per config",
    )
    bench.add_argument("--no-quality", action="store_true", help="skip the quality columns")
    bench.add_argument("--ppl-docs", type=int, default=d.ppl_docs)
    bench.add_argument("--ppl-length", type=int, default=d.ppl_length)
    bench.add_argument(
        "--passkey-lengths", default=",".join(map(str, d.passkey_lengths)), help="comma-separated"
    )
    bench.add_argument("--passkey-keys", type=int, default=d.passkey_keys)
    bench.add_argument("--no-reference", action="store_true", help="skip transformers generate")
    bench.add_argument("--reference-batch", type=int, default=d.reference_batch)
    bench.add_argument("--output", type=Path, default=Path("bench_results"))
    bench.add_argument("--perf-md", type=Path, default=None, help="also write a section here")
    bench.add_argument("--no-progress", action="store_true")
    bench.set_defaults(run=_bench)


def _bench(args: argparse.Namespace) -> int:
    import shlex

    from etjax.bench.ablation import BenchPlan, count_work, run_ablation
    from etjax.bench.output import write_outputs
    from etjax.bench.stages import StageProgress
    from etjax.bench.workload_file import run_label
    from etjax.host_limits import warn_if_map_count_low

    plan = BenchPlan(
        workload=args.workload,
        configs=tuple(c.strip() for c in args.configs.split(",") if c.strip()),
        model=args.model,
        requests=args.requests,
        repetitions=args.repetitions,
        seed=args.seed,
        load=args.load,
        arrivals=args.arrivals,
        quality=not args.no_quality,
        ppl_docs=args.ppl_docs,
        ppl_length=args.ppl_length,
        passkey_lengths=tuple(_positive_ints("--passkey-lengths", args.passkey_lengths)),
        passkey_keys=args.passkey_keys,
        reference=not args.no_reference,
        reference_batch=args.reference_batch,
        equal_length=args.equal_length,
    )
    warn_if_map_count_low()  # before an hour of work, not after
    progress = StageProgress(count_work(plan), enabled=not args.no_progress)
    raw = run_ablation(plan, on_progress=progress.stage)
    progress.close()
    command = "etjax " + shlex.join(sys.argv[1:] if sys.argv[1:2] == ["bench"] else ["bench"])
    label = run_label(plan.workload, plan.equal_length, plan.load, plan.arrivals)
    paths = write_outputs(raw, args.output / label, command, args.perf_md)
    for kind, path in paths.items():
        print(f"{kind}: {path}", file=sys.stderr)
    return 0


def _positive_ints(flag: str, text: str) -> list[int]:
    from etjax.errors import ConfigError

    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{flag}={text!r}: expected comma-separated integers") from None
    if not values or min(values) <= 0:
        raise ConfigError(f"{flag}={text!r}: expected positive integers")
    return values


def _batch(args: argparse.Namespace) -> int:
    import json

    from etjax import path_checks
    from etjax.distributed import processes
    from etjax.jobs.batch import run_batch, shard_path
    from etjax.jobs.output_lock import output_lock
    from etjax.loaders.resolve import load_model
    from etjax.run_config import is_model_preset, load_run_config

    # Paths and environment first: a mistake there costs a second, not a model load.
    if args.process_index is None:
        args.process_index = path_checks.env_int("ETJAX_PROCESS_INDEX", 0, minimum=0)
    if args.process_count is None:
        args.process_count = path_checks.env_int("ETJAX_PROCESS_COUNT", 1, minimum=1)
    path_checks.input_file(args.input)
    path_checks.output_file(args.output, args.input)
    group = processes.ProcessGroup(args.process_index, args.process_count, distributed=False)
    parts = lambda count: [shard_path(args.output, i, count) for i in range(count)]  # noqa: E731
    if args.merge:
        merged = processes.merge_shards(args.input, args.output, parts(group.count))
        log.info("merged %d results into %s", merged, args.output)
        return 0
    # Before joining: a bad config fails alone, fast.
    preset = args.model if args.model and is_model_preset(args.model) else None
    config = load_run_config(args.config, model=preset)
    if args.coordinator:
        group = processes.join(
            args.coordinator, args.process_count, args.process_index, args.timeout
        )
    name = config.model.name if preset or not args.model else args.model
    # The output's lock before the model: a second job on the same output fails in a second.
    with output_lock(shard_path(args.output, group.index, group.count)):
        calibration = args.calibration or config.model.calibration
        model = load_model(
            name,
            dtype=config.model.dtype,
            calibration=calibration,
            weights=config.model.weights,
        )
        summary = run_batch(
            args.input,
            args.output,
            config,
            model,
            group.index,
            group.count,
            show_progress=not args.no_progress,
            redo_changed=args.redo_changed,
        )
        if args.ordered and group.count == 1:
            processes.merge_shards(args.input, args.output, [args.output])
    print(json.dumps(summary, indent=2), file=sys.stderr)
    if group.distributed and group.count > 1:
        processes.barrier(group, "etjax-batch-shards-done", args.timeout)
        if group.index == 0:
            merged = processes.merge_shards(args.input, args.output, parts(group.count))
            log.info("merged %d results into %s", merged, args.output)
        processes.barrier(group, "etjax-batch-merged", args.timeout)
    return 0


def _convert(args: argparse.Namespace) -> int:
    from etjax import path_checks
    from etjax.loaders.checkpoint import save_model
    from etjax.loaders.resolve import load_model

    path_checks.new_directory(args.destination)
    started = time.perf_counter()
    model = load_model(args.source, dtype=args.dtype, weights=args.weights)
    save_model(model, args.destination)
    print(
        f"saved {model!r} to {args.destination} in {time.perf_counter() - started:.1f}s; "
        f"load it with etjax.load_model({str(args.destination)!r})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
