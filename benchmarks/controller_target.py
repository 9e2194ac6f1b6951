"""The entropic controller's target: fixed H* = 1.6 nats against a target tracking T = 0.7.

H* = 1.6 was calibrated to fixed T = 0.7's mean sampled entropy on news continuations
(benchmarks/sampler_quality.py). The ablation's requests are instruct answers, whose entropy
at T = 0.7 is another. This runs three samplers on two kinds of text with SmolLM2-135M-Instruct
(the ablation's model) and the same seeds:

- fixed T = 0.7 (the ablation's baseline sampler);
- entropic, H* = 1.6 nats (sampling_only and full before 2026-12-05);
- entropic, `target_from_temperature` at T = 0.7 (their sampler since).

Texts: the `mixed` workload's requests without the long documents (instruct answers, 64-256
new tokens, eos allowed; `--seeds` draws of each), and Lee-corpus openings of 48 tokens
continued for up to 200 tokens (the calibration's text; one draw each). Per sampler and
text: the sampled entropy's mean and variance over every generated token, tokens generated,
the share of requests that ended by eos, and the mean log-probability under the model (T = 1).
Writes the "controller_target" section of docs/PERF.md.

    .venv/bin/python benchmarks/controller_target.py [--requests 24] [--seeds 4]
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.perf_report import machine_line, write_section

MODEL = "smollm2-135m-instruct"
OPENING_TOKENS = 48
CONTINUATION_TOKENS = 200


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--seeds", type=int, default=4)
    args = parser.parse_args()

    import etjax
    from etjax.bench.corpus import lee_articles
    from etjax.bench.workloads import mixed
    from etjax.engine_build import RequestSettings, generate_ids
    from etjax.sampling import SamplerSettings

    model = etjax.load_model(MODEL)
    tok = model.tokenizer
    lee = lee_articles()
    answers = [r for r in mixed(tok, lee, 2 * args.requests) if r.kind != "long"]
    texts = {
        "instruct answers (`mixed` without its documents)": (
            [r.token_ids(tok) for r in answers[: args.requests]],
            [r.max_new_tokens for r in answers[: args.requests]],
            args.seeds,
        ),
        "news continuations (the 1.6 calibration's text)": (
            [tok.encode(lee[i])[:OPENING_TOKENS] for i in range(args.requests)],
            [CONTINUATION_TOKENS] * args.requests,
            1,
        ),
    }
    samplers = {
        "fixed T = 0.7": dict(sampler="standard", temperature=0.7),
        "entropic, H* = 1.6": dict(sampler="entropic", temperature=0.7, target_entropy=1.6),
        "entropic, tracking T = 0.7": dict(
            sampler="entropic", temperature=0.7, target_from_temperature=True
        ),
    }
    results: dict[str, dict[str, dict]] = {}
    for text, (prompts, lengths, seeds) in texts.items():
        results[text] = {}
        for name, fields in samplers.items():
            outs = []
            for draw in range(seeds):  # every sampler gets the same seeds
                settings = [
                    RequestSettings(
                        max_new_tokens=m, sampler=SamplerSettings(seed=1000 * draw + i, **fields)
                    )
                    for i, m in enumerate(lengths)
                ]
                outs += generate_ids(model.weights, model.config, tok, prompts, settings)
            results[text][name] = _metrics(outs)
            print(text, name, results[text][name], flush=True)
    raw = {
        "machine": machine_line(),
        "date": str(datetime.date.today()),
        "requests": args.requests,
        "seeds": args.seeds,
        "results": results,
    }
    write_section("controller_target", _markdown(raw), raw)


def _metrics(outs) -> dict:
    sampled = np.concatenate([o.sampled_entropy for o in outs])
    return {
        "entropy_mean": float(sampled.mean()),
        "entropy_var": float(sampled.var()),
        "tokens": int(sum(len(o.token_ids) for o in outs)),
        "eos_fraction": float(np.mean([o.finish_reason == "eos" for o in outs])),
        "logprob_mean": float(np.mean(np.concatenate([o.logprob for o in outs]))),
        "runs": len(outs),
    }


def _markdown(raw: dict) -> str:
    lines = [
        f"## The controller's target: fixed against tracking the base temperature ({MODEL})",
        "",
        f"Measured {raw['date']} on {raw['machine']}. Command: `.venv/bin/python "
        f"benchmarks/controller_target.py --requests {raw['requests']} --seeds {raw['seeds']}`. "
        "Instruct answers: the `mixed` workload's first requests without its long documents "
        f"(64-256 new tokens, eos allowed), {raw['seeds']} seeded draws each; news "
        f"continuations: Lee-corpus openings of {OPENING_TOKENS} tokens continued for up to "
        f"{CONTINUATION_TOKENS}, one draw each. The same seeds for every sampler.",
        "",
        "| text | sampler | sampled H mean | sampled H variance | tokens generated "
        "| ended by eos | mean log-prob |",
        "|---|---|---|---|---|---|---|",
    ]
    for text, by_sampler in raw["results"].items():
        base = next(iter(by_sampler.values()))
        for name, m in by_sampler.items():
            lines.append(
                f"| {text} | {name} | {m['entropy_mean']:.3f} | {m['entropy_var']:.3f} | "
                f"{m['tokens']} ({m['tokens'] / base['tokens']:.2f}x) | "
                f"{m['eos_fraction']:.0%} | {m['logprob_mean']:.3f} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
