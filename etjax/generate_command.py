"""`etjax generate`: one prompt from the command line, streamed, with every decode option.

Each request field open to the command line (etjax/request_fields.py) and each
`SamplerSettings` field is a flag of its own (`--max-new-tokens`, `--top-p`, ...). `--config`
takes a run config's [model], [sampler], [request], pruning and speculation settings as the
defaults; flags given on the command line win. Everything is checked before the model loads,
so a bad value fails in a second.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time

from etjax.model.quantized import WEIGHTS_CHOICES
from etjax.request_fields import CLI, DECODE, open_at, read_fields
from etjax.sampling.settings import SAMPLERS, SamplerSettings

log = logging.getLogger("etjax")
_TYPES = {"int": int, "float": float, "str": str}


def add_generate(commands) -> None:
    gen = commands.add_parser(
        "generate",
        help="generate a completion and stream it",
        description=__doc__,
        # Each flag's help names its own default (None here means "not given").
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--model", default=None, help="name, path or hub id (default: embedded)")
    gen.add_argument("--config", default=None, help="a run config whose settings are defaults")
    gen.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16"])
    gen.add_argument(
        "--weights",
        default=None,
        choices=WEIGHTS_CHOICES,
        help="how the matrices are held: a GGUF's blocks as stored, the same blocks multiplied "
        "by rows rounded to int8 (stored-int8-rows), int8 per channel, a float dtype "
        "(default: the config's, else auto: a quantized GGUF's blocks in float32 on one CPU, "
        "else floats in --dtype)",
    )
    gen.add_argument(
        "--calibration",
        default=None,
        help="a file written by `etjax calibrate` (default: the config's model's, if any)",
    )
    gen.add_argument("--pruning", action="store_true", default=None, help="entropic pruning")
    gen.add_argument(
        "--speculation", action="store_true", default=None, help="draft and verify tokens"
    )
    request = gen.add_argument_group("request (etjax/request_fields.py)")
    for name, row in open_at(CLI).items():
        # None: the flag was not given, so --config's [request] value (or the table's) holds.
        kwargs = {"dest": name, "default": None, "help": f"{row.help} (default {row.default})"}
        if row.type == "bool":  # a switch: --name / --no-name
            kwargs["action"] = argparse.BooleanOptionalAction
        elif row.type.startswith("tuple"):  # a list: the flag repeats
            kwargs |= {"action": "append", "help": f"{row.help} (repeatable)"}
        else:
            kwargs["type"] = _TYPES[row.type.removesuffix(" | None")]
        request.add_argument(*row.flags, **kwargs)
    gen.add_argument("--seed", type=int, default=None, help="(default: a fresh seed)")
    sampler = gen.add_argument_group("sampler (etjax.sampling.SamplerSettings)")
    for f in dataclasses.fields(SamplerSettings):
        if f.name == "seed":
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool":  # a switch: --name / --no-name
            kwargs = {"action": argparse.BooleanOptionalAction}
        else:
            kwargs = {"type": _TYPES[f.type]}
            if f.name == "sampler":
                kwargs["choices"] = SAMPLERS
        sampler.add_argument(flag, default=None, help=f"(default {f.default})", **kwargs)
    gen.add_argument(
        "--show-entropy", action="store_true", help="print each token with its entropy after"
    )
    gen.set_defaults(run=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from etjax.api import decode
    from etjax.loaders.resolve import load_model
    from etjax.request_checks import sampler_settings
    from etjax.run_config import RunConfig, load_run_config

    config = load_run_config(args.config) if args.config else RunConfig("built-in defaults")
    given = lambda value, default: default if value is None else value  # noqa: E731
    sampler = dataclasses.asdict(config.sampler)
    for name in sampler:
        flag_value = getattr(args, name, None)
        if flag_value is not None:
            sampler[name] = flag_value
    seed = args.seed  # None: a fresh one, reported below
    sampler.pop("seed")
    flags = {name: getattr(args, name) for name in open_at(CLI)}
    # The settings first: a bad value fails in a second, not after the model has loaded.
    request = read_fields(
        {name: value for name, value in flags.items() if value is not None},
        CLI,
        dataclasses.asdict(config.request),
    )
    options = {k: v for k, v in sampler.items() if k not in ("sampler", "temperature")}
    sampler_settings(sampler["sampler"], sampler["temperature"], 0, dict(options))
    pruning = True if args.pruning else config.options.pruning
    speculation = True if args.speculation else config.options.speculation
    started = time.perf_counter()
    model = load_model(
        args.model or config.model.name,
        dtype=given(args.dtype, config.model.dtype),
        weights=given(args.weights, config.model.weights),
        calibration=given(args.calibration, config.model.calibration),
    )
    log.info("%r loaded in %.1fs", model, time.perf_counter() - started)
    n = request["n"]

    def stream(_: int, piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    started = time.perf_counter()
    results = decode(
        args.prompt,
        model=model,
        pruning=pruning,
        speculation=speculation,
        seed=seed,
        sampler=sampler["sampler"],
        temperature=sampler["temperature"],
        raise_on_invalid=True,
        on_text=stream if n == 1 else None,
        **{name: request[name] for name in open_at(DECODE)},
        **options,
    )
    elapsed = time.perf_counter() - started
    for j, result in enumerate(results):
        if n > 1:
            print(f"--- sample {j + 1} of {n} (seed {result.seed}) ---")
            print(result.text, end="")
        print()
        _report(result, elapsed, model.tokenizer, args.show_entropy)
    # A constrained request the grammar engine failed on is a failure, whatever it printed.
    failed = [r for r in results if r.finish_reason == "error"]
    for r in failed:
        log.error("generation failed (seed %d): %s", r.seed, r.error)
    return 1 if failed else 0


def _report(result, elapsed: float, tokenizer, show_entropy: bool) -> None:
    n = len(result.token_ids)
    print(
        f"[{n} tokens in {elapsed:.1f}s (compilation included), finish: {result.finish_reason}, "
        f"seed {result.seed}, mean entropy {sum(result.entropy) / max(n, 1):.3f} nats]",
        file=sys.stderr,
    )
    if show_entropy:
        print(f"\n{'step':>4}  {'H model':>8}  {'H sampled':>9}  {'T':>5}  {'tau':>6}  token")
        rows = zip(
            result.token_ids,
            result.entropy,
            result.sampled_entropy,
            result.temperature,
            result.tau,
            strict=True,
        )
        for step, (token, h, hs, t, tau) in enumerate(rows):
            text = tokenizer.decode([token])
            print(f"{step:>4}  {h:8.3f}  {hs:9.3f}  {t:5.2f}  {tau:6.2f}  {text!r}")
