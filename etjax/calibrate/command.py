"""`etjax calibrate`: fit a model's entropy calibration to text files and write it as JSON."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from etjax.calibrate.fit import MIN_TOKENS
from etjax.errors import CalibrationError

DESCRIPTION = """Fit the temperature of a model's entropy signal to text (minimising the
next-token NLL with optax's L-BFGS) and write it to a small JSON file. Load it with
etjax.load_model(MODEL, calibration=PATH): pruning, the scheduler and drafting then read the
calibrated entropy; sampling is unchanged. The file also holds the shift of the pruning
ramp that keeps the default budget under the calibrated signal on the same text (the engine
moves its thresholds by it). Pass --held-out text the fit does not see to judge it: the file
records NLL, top-token ECE and the entropy - surprisal gap before and after, and the model's
identity (architecture, sizes, a fingerprint of its weights): a load with another model is
refused."""


def add_calibrate(commands) -> None:
    """Register `etjax calibrate` on the CLI's subcommands."""
    cal = commands.add_parser(
        "calibrate",
        help="fit a model's entropy calibration to text (writes a JSON file)",
        description=DESCRIPTION,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    cal.add_argument("--model", default=None, help="name, path or hub id (default: embedded)")
    cal.add_argument(
        "--text", nargs="+", type=Path, required=True, help="UTF-8 text files to fit on"
    )
    cal.add_argument(
        "--held-out", nargs="+", type=Path, default=None, help="UTF-8 text files to report on"
    )
    cal.add_argument("--output", type=Path, required=True, help="the calibration file to write")
    cal.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    cal.add_argument(
        "--window",
        type=int,
        default=512,
        help="tokens per teacher-forced window (a multiple of 16)",
    )
    cal.add_argument(
        "--max-tokens",
        type=int,
        default=4096,
        help=f"scored positions the fit holds (at least {MIN_TOKENS}, as --text and --held-out "
        "must hold)",
    )
    cal.set_defaults(run=_calibrate)


def _calibrate(args: argparse.Namespace) -> int:
    # Files first: a mistake there costs a second, not a model load.
    texts = _read_texts(args.text, "--text")
    held = None if args.held_out is None else _read_texts(args.held_out, "--held-out")
    out = args.output
    if out.is_dir() or not (out.parent if str(out.parent) else Path(".")).is_dir():
        raise CalibrationError(f"--output {out}: needs a file path in an existing folder")
    if any(out.resolve() == p.resolve() for p in args.text + (args.held_out or [])):
        raise CalibrationError(f"--output {out} is one of the text files; write it elsewhere")
    from etjax.calibrate.fit import calibrate
    from etjax.calibration.file import save_calibration
    from etjax.loaders.resolve import load_model

    model = load_model(args.model, dtype=args.dtype)
    result = calibrate(model, texts, held, window=args.window, max_tokens=args.max_tokens)
    save_calibration(result, out)
    print(json.dumps(result.to_json(), indent=2), file=sys.stderr)
    print(
        f"wrote {out}: temperature {result.temperature:.4f}, "
        f"pruning ramp shift {result.ramp_shift:+.3f} nats"
    )
    return 0


def _read_texts(paths: list[Path], flag: str) -> list[str]:
    texts = []
    for path in paths:
        if not path.is_file():
            raise CalibrationError(f"{flag} {path}: file not found")
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise CalibrationError(f"{flag} {path}: not UTF-8 text ({e})") from None
    return texts
