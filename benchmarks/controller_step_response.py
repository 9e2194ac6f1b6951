"""Step responses of the entropic temperature controller on a stationary distribution.

The plant is a Zipf-like distribution over SmolLM2's vocabulary (logits -1.1 log rank, V =
49152). The controller first settles at H* = 2 nats, then the target steps to 4 nats (and
back). For several gains, as fractions of 1/M (M: the largest varentropy over [T_min, T_max]),
it reports overshoot, settling time to within 0.05 nats, and the step bound N(0.05) of
docs/STABILITY.md Theorem 2 (which applies for gain <= 1/M). One control-law application per
step. Writes the "controller_step_response" section of docs/STABILITY.md.

    .venv/bin/python benchmarks/controller_step_response.py
"""

from __future__ import annotations

import datetime
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.perf_report import ROOT, machine_line, write_section
from etjax.entropy.controller import ControllerParams, controller_step
from etjax.entropy.estimators import exact_entropy
from tests.controller_theory import entropy_and_slope, slope_range, steps_to_converge

T_MIN, T_MAX, MAX_STEP, TOL = 0.1, 2.0, 0.25, 0.05
STEPS = 300


def main() -> None:
    z = (-1.1 * np.log(np.arange(1, 49153))).astype(np.float32)[None]
    u_min, u_max = math.log(T_MIN), math.log(T_MAX)
    m, big_m = slope_range(z[0], u_min, u_max)
    step = jax.jit(controller_step)
    model_h = exact_entropy(jnp.asarray(z))
    rows = []
    for fraction in (0.25, 0.5, 1.0, 1.5, 1.9):
        gain = fraction / big_m
        for start, target in ((2.0, 4.0), (4.0, 2.0)):
            u_start = _solve(z[0], start, u_min, u_max)
            u_target = _solve(z[0], target, u_min, u_max)
            lo, hi = sorted((u_start, u_target))
            m_local, big_m_local = slope_range(z[0], lo, hi, points=201)
            u = jnp.asarray([u_start], jnp.float32)
            params = ControllerParams(
                target_entropy=jnp.asarray([target], jnp.float32),
                log_t_min=jnp.asarray([u_min], jnp.float32),
                log_t_max=jnp.asarray([u_max], jnp.float32),
                gain=jnp.asarray([gain], jnp.float32),
                max_step=jnp.asarray([MAX_STEP], jnp.float32),
                entropy_floor=jnp.asarray([0.0], jnp.float32),
                track_base=jnp.asarray([False]),
                log_t_base=jnp.asarray([0.0], jnp.float32),
            )
            trace = []
            for _ in range(STEPS):
                out = step(jnp.asarray(z), model_h, u, params)
                trace.append(float(out.sampled_entropy[0]))
                u = out.log_temperature
            trace = np.array(trace)
            direction = np.sign(target - start)
            overshoot = max(0.0, float(np.max(direction * (trace - target))))
            outside = np.nonzero(np.abs(trace - target) >= TOL)[0]
            settle = int(outside[-1]) + 2 if len(outside) else 1
            bound = local = None
            if fraction <= 1.0:
                bound = steps_to_converge(u_min, u_max, gain, MAX_STEP, m, big_m, TOL)
                local = steps_to_converge(lo, hi, gain, MAX_STEP, m_local, big_m_local, TOL)
            rows.append((fraction, gain, start, target, overshoot, settle, local, bound))
            print(rows[-1], flush=True)
    raw = {
        "machine": machine_line(),
        "date": str(datetime.date.today()),
        "m": m,
        "M": big_m,
        "rows": rows,
    }
    write_section("controller_step_response", _markdown(raw), raw, ROOT / "docs" / "STABILITY.md")


def _solve(z: np.ndarray, target: float, lo: float, hi: float) -> float:
    # Bisection for f(u) = target (f is nondecreasing): the settled state before the step.
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if entropy_and_slope(z, mid)[0] < target else (lo, mid)
    return 0.5 * (lo + hi)


def _markdown(raw: dict) -> str:
    lines = [
        "### Measured step responses",
        "",
        f"Measured {raw['date']} on {raw['machine']} with "
        "`.venv/bin/python benchmarks/controller_step_response.py`. Plant: logits "
        "-1.1 log(rank) over 49,152 tokens; T in [0.1, 2]; max_step 0.25; one application of "
        f"the law per step. On [log 0.1, log 2] this plant has m = {raw['m']:.3f} and "
        f"M = {raw['M']:.3f} (min and max varentropy). The global bound uses m and M over the "
        "whole range, the local one over the interval between the old and the new settling "
        "point (Theorem 2, part 4).",
        "",
        "| gain (x 1/M) | gain | target step (nats) | overshoot (nats) | settling steps "
        "(within 0.05) | local bound N(0.05) | global bound N(0.05) |",
        "|---|---|---|---|---|---|---|",
    ]
    for fraction, gain, start, target, overshoot, settle, local, bound in raw["rows"]:
        na = "n/a (gain > 1/M)"
        lines.append(
            f"| {fraction} | {gain:.4f} | {start:.0f} -> {target:.0f} | {overshoot:.3f} | "
            f"{settle} | {local if local is not None else na} | "
            f"{bound if bound is not None else na} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
