"""A tiny Qwen3-MoE trained here on the Lee corpus, for the entropy-steered experts experiment.

No real mixture-of-experts checkpoint can be had on these machines (no model hub; no PyPI
package ships one small enough), so benchmarks/entropy_experts.py measures on this: 4 layers,
hidden 128, 8 experts of width 128 with the top 2 run per token (weights renormalised, as
Qwen3-30B-A3B's), tied embeddings, and a byte-level BPE vocabulary of 4,096 tokens trained on
the same articles. It is trained with transformers' own Qwen3-MoE class (torch, AdamW, the
router's load-balancing loss on), so the folder it saves is exactly the model trained, in the
layout etjax loads, with no conversion to get wrong. Seeded and single-process: the same
command writes the same weights on the same machine.

Why its own vocabulary: with SmolLM2's 49,152 tokens the LM head cost most of a training step
on two cores, and 200 steps left a model whose entropy on held-out text never fell below 6
nats (the unused tokens' share of the softmax alone keeps it high) — nothing for an entropy
threshold to act on. A small vocabulary learns the corpus's regularities in minutes.

    .venv/bin/python benchmarks/tiny_moe.py OUT_DIR [--steps 200]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TRAIN_ARTICLES = 240  # the first 240 Lee articles train; 240..299 are held out
SEQ = 128
BATCH = 16
SEED = 0
VOCAB = 4096


def tiny_moe_config(vocab_size: int):
    """transformers' Qwen3-MoE config of the trained model."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,  # unused: every layer is sparse
        moe_intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        output_router_logits=True,  # the load-balancing loss, while training
        router_aux_loss_coef=0.01,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=0,
        eos_token_id=0,
    )


def corpus_tokenizer(articles: list[str]):
    """A byte-level BPE tokenizer of VOCAB tokens trained on `articles` (transformers' fast
    tokenizer around it; token 0 is <|endoftext|>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(articles, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<|endoftext|>", eos_token="<|endoftext|>"
    )


def token_stream(tokenizer, articles: list[str]) -> np.ndarray:
    """The articles' tokens, one stream, each article followed by a blank line."""
    ids: list[int] = []
    for article in articles:
        ids += tokenizer.encode(article + "\n\n", add_special_tokens=False)
    return np.asarray(ids, np.int64)


def train(out: Path, steps: int, log=print) -> dict:
    """Train the tiny model for `steps` AdamW steps of BATCH x SEQ tokens drawn (seeded) from
    the training articles, and save it with its tokenizer to `out`. Returns what was done."""
    import torch
    from transformers import AutoModelForCausalLM

    from etjax.bench.corpus import lee_articles

    torch.manual_seed(SEED)
    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(True)
    articles = lee_articles()[:TRAIN_ARTICLES]
    tokenizer = corpus_tokenizer(articles)
    stream = token_stream(tokenizer, articles)
    config = tiny_moe_config(len(tokenizer))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=3e-3, total_steps=steps, pct_start=0.05
    )
    rng = np.random.default_rng(SEED)
    start, losses = time.perf_counter(), []
    model.train()
    for step in range(steps):
        offsets = rng.integers(0, len(stream) - SEQ - 1, size=BATCH)
        batch = torch.from_numpy(np.stack([stream[o : o + SEQ] for o in offsets]))
        # The next-token loss and the router's load-balancing loss (output_router_logits).
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == steps - 1:
            elapsed = time.perf_counter() - start
            log(f"step {step}: loss {np.mean(losses[-50:]):.3f} ({elapsed:.0f} s)")
    model.config.output_router_logits = False
    model.eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {
        "steps": steps,
        "batch": BATCH,
        "seq": SEQ,
        "train_tokens": len(stream),
        "vocab_size": len(tokenizer),
        "final_loss": float(np.mean(losses[-50:])),
        "train_seconds": time.perf_counter() - start,
        "parameters": int(model.num_parameters()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    print(train(args.out, args.steps))


if __name__ == "__main__":
    main()
