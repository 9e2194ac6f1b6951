"""`etjax plan MODEL --topology NAME`: the plan (plan.py) as text, or as one JSON object."""

from __future__ import annotations

import argparse
import json
import sys

_GIB = 2**30


def add_plan(commands) -> None:
    """Register `etjax plan` on the CLI's subcommands."""
    cmd = commands.add_parser(
        "plan",
        help="compile the engine for a TPU topology (no TPU needed) and say what fits",
        description="Compile the engine's step programs for a TPU topology with libtpu (pip "
        "install 'etjax[tpu]'; no TPU needed, nothing is downloaded) and report per chip the "
        "weights, KV pool, state and program bytes against HBM, the largest pool, batch and "
        "context that fit, and a modelled decode speed (a roofline, not a measurement). Exit "
        "status 0 for a plan, whether the model fits or not; 1 when the TPU compiler crashed "
        "on or refused a program (named, with the signal or the compiler's message; the plan "
        "is printed without it); 2 for bad input.",
    )
    cmd.add_argument("model", help="a .gguf file, or a Hugging Face folder (config.json alone)")
    cmd.add_argument("--topology", default="v5e-1", help="v5e-1, v5e-4, v5e-8, v6e-1, v6e-8, ...")
    cmd.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    cmd.add_argument(
        "--weights",
        default="auto",
        choices=("auto", "int8", "bfloat16", "float32"),
        help="how the matrices are held, as load_model's weights option (default: auto)",
    )
    cmd.add_argument("--config", default=None, help="a name in configs/ or a .toml path")
    cmd.add_argument("--batch", type=int, default=None, help="rows (default: the config's)")
    cmd.add_argument(
        "--context",
        type=int,
        default=None,
        help="tokens a row, the engine's max_context (default: the config's, else 4096)",
    )
    cmd.add_argument("--kv-dtype", default=None, help="the KV pool's dtype (default: model's)")
    cmd.add_argument("--mesh", default=None, help="DATAxMODEL (default: 1xCHIPS)")
    prune = cmd.add_mutually_exclusive_group()
    prune.add_argument("--pruning", dest="pruning", action="store_true", default=None)
    prune.add_argument("--no-pruning", dest="pruning", action="store_false")
    cmd.add_argument(
        "--layers", type=int, default=2, help="layers the programs are compiled with (0: all)"
    )
    cmd.add_argument("--no-compile", action="store_true", help="count only; compile nothing")
    cmd.add_argument(
        "--hbm-fraction", type=float, default=None, help="HBM share to plan (default: config's)"
    )
    cmd.add_argument("--json", action="store_true", help="print one JSON object")
    cmd.set_defaults(run=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    from etjax.planning.plan import plan

    result = plan(
        args.model,
        args.topology,
        args.dtype,
        args.config,
        batch=args.batch,
        context=args.context,
        kv_dtype=args.kv_dtype,
        pruning=args.pruning,
        mesh=args.mesh,
        layers=args.layers,
        compile_programs=not args.no_compile,
        hbm_fraction=args.hbm_fraction,
        weights=args.weights,
    )
    if args.json:
        print(json.dumps(result.as_dict()))
    else:
        sys.stdout.write(render(result.as_dict()))
    # A program the TPU compiler crashed on or refused leaves the plan incomplete: an error,
    # said plainly (a model that does not fit is an answer, exit 0).
    for error in result.errors:
        print(f"etjax: error: {error}", file=sys.stderr)
    return 1 if result.errors else 0


def render(d: dict) -> str:
    """The plan as text."""

    def gib(n: float) -> str:
        return f"{n / _GIB:.2f} GiB"

    verdict = {True: "fits", False: "does not fit", None: "fit not known"}[d["fits"]]
    lines = [
        f"{d['model']} on {d['topology']} (mesh {d['mesh']}), {d['dtype']}, weights "
        f"{d['weights']}, KV {d['kv_dtype']}: {verdict}",
        f"  per chip, of {gib(d['hbm_bytes_per_chip'])} HBM ({d['hbm_fraction']:.0%} planned):",
        f"    weights   {gib(d['weights_bytes_per_chip'])} (all chips {gib(d['weights_bytes'])})",
        f"    KV pool   {gib(d['kv_pool_bytes_per_chip'])} ({d['batch']} rows x "
        f"{d['context']} tokens)",
        f"    state     {gib(d['state_bytes_per_chip'])}",
        f"    programs  {gib(d['program_bytes_per_chip'])} (scratch and code, compiled at "
        f"{d['compiled_layers']} layers)",
        f"  largest: KV pool {gib(d['max_kv_pool_bytes_per_chip'])} a chip; "
        f"{d['max_batch_at_context']} rows at {d['context']} tokens; "
        f"{d['max_context_at_batch']} tokens at {d['batch']} rows",
    ]
    for p in d["programs"]:
        kernels = ", ".join(p["kernels"]) or "none"
        lines.append(
            f"  {p['name']}: compiled in {p['compile_s']:.1f} s, scratch {gib(p['temp_bytes'])}"
            f", Mosaic kernels: {kernels}"
        )
        if p["collectives"]:
            named = ", ".join(
                f"{c['count']} {c['kind']} ({c['bytes'] / 1e3:.1f} kB)" for c in p["collectives"]
            )
            lines.append(f"    collectives, each once as written: {named}")
        if p["layer_collectives"]:
            named = ", ".join(
                f"{c['kind']} after {c['after']} ({c['bytes'] / 1e3:.1f} kB)"
                for c in p["layer_collectives"]
            )
            lines.append(f"    a layer's collectives: {named}")
            lines.append(
                f"    collectives a step, all layers: {p['step_collective_bytes'] / 1e6:.2f} MB"
            )
    for name, m in d["modelled"].items():
        lines.append(
            f"  modelled decode ({name}, {m['rows']} rows, {m['bound']}-bound): "
            f"{m['step_s'] * 1e3:.2f} ms a step, {m['tokens_per_s']:.0f} tokens/s "
            f"({m['tokens_per_s_per_chip']:.0f} a chip)"
        )
    lines += [f"  would fit: {s}" for s in d["suggestions"]]
    lines += [f"  error: {e}" for e in d["errors"]]
    if d["errors"]:
        lines.append("  (the figures above leave out the scratch of what did not compile)")
    return "\n".join(lines) + "\n"
