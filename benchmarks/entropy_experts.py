"""Entropy-steered experts: expert FLOPs saved against perplexity, on a tiny MoE trained here.

No real mixture-of-experts checkpoint can be had on these machines, so this measures the
model benchmarks/tiny_moe.py trains on the first 240 Lee articles (a 4-layer Qwen3-MoE, 8
experts, top 2, its own 4,096-token BPE vocabulary; trained first when `--model` holds
none). On the 60 held-out articles, cut into documents of 32 + 512 tokens, the last 512
tokens of each are fed one at a time through the decode path (etjax/bench/perplexity.py): a
token whose predicting distribution had an entropy below the threshold runs k' = 1 expert
of its 2, as `ExpertConfig` does in decode steps. Reported per threshold: the perplexity
ratio to full k (all documents' tokens, and the worst document), the fraction of tokens
that ran k', and the expert FLOPs saved (the fed tokens' expert products not run; the
router and every other product still run). A control runs k' on the same fraction of
tokens picked at random, blind to entropy: what the signal adds over merely running fewer
experts. Writes the "entropy_experts" section of docs/PERF.md.

    .venv/bin/python benchmarks/entropy_experts.py [--model DIR] [--thresholds 3.5,4,4.5,5,5.5,6]
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.perf_report import machine_line, write_section
from benchmarks.tiny_moe import TRAIN_ARTICLES, token_stream, train
from etjax.bench.perplexity import EVAL_TOKENS, ExpertSteering, perplexity, prefill_documents
from etjax.entropy.cost import CostModel
from etjax.pruning.config import PruningConfig

PREFIX = 32  # tokens prefilled (all k) before the scored ones
DEFAULT_MODEL = Path("/tmp/etjax-tiny-moe")
SEED = 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--thresholds", default="3.5,4,4.5,5,5.5,6")
    parser.add_argument("--steps", type=int, default=200, help="training steps, if it trains")
    parser.add_argument(
        "--part", default="", help="suffix of the PERF.md section, to keep several runs"
    )
    args = parser.parse_args()

    from transformers import AutoTokenizer

    import etjax
    from etjax.bench.corpus import lee_articles

    if not (args.model / "config.json").is_file():
        info = train(args.model, args.steps)
        (args.model / "training.json").write_text(json.dumps(info, indent=2) + "\n")
    training = json.loads((args.model / "training.json").read_text())
    model = etjax.load_model(args.model, dtype="float32")
    cfg = model.config
    tokenizer = AutoTokenizer.from_pretrained(args.model)  # the one it was trained with
    stream = token_stream(tokenizer, lee_articles()[TRAIN_ARTICLES:])
    length = PREFIX + EVAL_TOKENS
    docs = [stream[i * length : (i + 1) * length].tolist() for i in range(len(stream) // length)]
    start = time.perf_counter()
    prefilled = prefill_documents(model, docs)
    dense = PruningConfig()
    shape = (EVAL_TOKENS, len(docs))
    full = perplexity(model, prefilled, dense)  # every token runs k experts
    rows = {}
    rng = np.random.default_rng(SEED)
    for threshold in (float(x) for x in args.thresholds.split(",")):
        steered = perplexity(
            model, prefilled, dense, experts=ExpertSteering.by_entropy(threshold, 1, shape)
        )
        blind = perplexity(
            model,
            prefilled,
            dense,
            experts=ExpertSteering.at_random(rng.random(shape) < steered["reduced"], 1),
        )
        rows[threshold] = {"entropy": steered, "random": blind}
        print(threshold, _summary(steered, full), _summary(blind, full), flush=True)
    cost = CostModel.for_model(cfg, page_size=16)
    raw = {
        "machine": machine_line(),
        "date": str(datetime.date.today()),
        "model": {
            "dir": str(args.model),
            "training": training,
            "embedding_parameters": cfg.vocab_size * cfg.hidden_size,
        },
        "documents": len(docs),
        "scored_tokens_per_document": EVAL_TOKENS,
        "full": full,
        "rows": {str(t): r for t, r in rows.items()},
        "measure_seconds": time.perf_counter() - start,
        # One expert over the sparse layers, against a token's matrix-product FLOPs.
        "expert_share_of_matmul_flops": cost.expert_flops / cost.matmul_flops_per_token,
    }
    _report(raw, full, rows, cost, args.part)


def _ratio(row: dict, full: dict) -> tuple[float, float]:
    # All documents' tokens (equal counts: exp of the mean log-perplexity) and the worst one.
    logs = np.log(row["ppl"]) - np.log(full["ppl"])
    return float(np.exp(logs.mean())), float(np.exp(logs.max()))


def _summary(row: dict, full: dict) -> str:
    ratio, worst = _ratio(row, full)
    return f"ratio {ratio:.4f} (worst {worst:.4f}), reduced {row['reduced']:.1%}"


def _report(raw: dict, full: dict, rows: dict, cost: CostModel, part: str) -> None:
    training = raw["model"]["training"]
    share = raw["expert_share_of_matmul_flops"]
    k = cost.experts_per_token
    lines = [
        f"## Entropy-steered experts (a tiny MoE trained here, {training['steps']} training steps)",
        "",
        f"Measured {raw['date']} on {raw['machine']}. Command: `.venv/bin/python "
        f"benchmarks/entropy_experts.py {shlex.join(sys.argv[1:])}`. No real "
        "mixture-of-experts checkpoint could be had here (no model hub; no PyPI package ships "
        "one), so the model is a tiny Qwen3-MoE trained on this machine by "
        "benchmarks/tiny_moe.py: 4 layers, hidden 128, 8 experts of width 128, top 2 "
        f"renormalised, a byte-level BPE vocabulary of {training['vocab_size']:,} tokens "
        f"trained on the same articles, {training['parameters']:,} parameters "
        f"({raw['model']['embedding_parameters']:,} of them the tied embedding), "
        f"{training['steps']} AdamW steps of {training['batch']}x{training['seq']} "
        f"tokens on the first {TRAIN_ARTICLES} Lee articles ({training['train_tokens']:,} "
        f"tokens; training loss at the end {training['final_loss']:.2f} nats, the router's "
        f"balancing term included; {training['train_seconds']:.0f} s). It is a weak model: "
        "what holds for it need not hold for a real one.",
        "",
        f"Held out: the other 60 articles, as {raw['documents']} documents of {PREFIX} "
        f"prefilled + {EVAL_TOKENS} scored tokens (full-k perplexity "
        f"{float(np.exp(np.log(full['ppl']).mean())):.1f}), fed one token at a time through "
        f"the decode path. A token whose predicting distribution had entropy below the "
        f'threshold runs 1 expert of {k}; "expert FLOPs saved" is the fraction of the fed '
        "tokens' expert products not run (one expert over all sparse layers is "
        f"{share:.1%} of a token's matrix-product FLOPs, the LM head included). "
        '"random": the same fraction of tokens at 1 expert, picked blind to entropy.',
        "",
        "| threshold (nats) | tokens at 1 expert | expert FLOPs saved | ppl ratio | worst "
        "document | random: ppl ratio |",
        "|---|---|---|---|---|---|",
    ]
    for threshold, r in rows.items():
        ratio, worst = _ratio(r["entropy"], full)
        blind, _ = _ratio(r["random"], full)
        saved = 1 - r["entropy"]["experts_run"]
        lines.append(
            f"| {threshold:g} | {r['entropy']['reduced']:.1%} | {saved:.1%} | {ratio:.4f} | "
            f"{worst:.4f} | {blind:.4f} |"
        )
    write_section(f"entropy_experts{part}", "\n".join(lines), raw)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
