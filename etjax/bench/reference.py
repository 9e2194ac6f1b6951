"""The outside reference: Hugging Face transformers `generate` on the same requests.

transformers runs the same weights (the GGUF dequantised by transformers itself, or the same
Hugging Face directory) in float32 PyTorch, greedy, in static batches of `batch_size` requests
taken in submission order and left-padded, as a user of `generate` would run them. Every
request arrives at time 0, so a request's latency is when its batch finished. Its greedy
outputs are compared with etjax's baseline greedy outputs: they should agree up to
floating-point near-ties, which makes the reference a check of etjax as well as a yardstick.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from etjax.bench.workloads import WorkloadRequest
from etjax.errors import EtjaxError


def load_reference(model_name: str | None):
    """transformers' float32 model for an etjax model name: the embedded SmolLM2 (None), a
    .gguf file or a Hugging Face directory."""
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise EtjaxError(
            "the transformers reference needs transformers and torch: pip install "
            "'etjax[test]' (or pass --no-reference)"
        ) from None
    from etjax.loaders.embedded import smollm2_gguf_path
    from etjax.loaders.resolve import _EMBEDDED_ALIASES

    if model_name is None or model_name.lower() in _EMBEDDED_ALIASES:
        path = smollm2_gguf_path()
    else:
        path = Path(model_name)
    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
    elif (path / "config.json").is_file():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    else:
        raise EtjaxError(
            f"{model_name}: transformers can only load a .gguf file or a Hugging Face "
            "directory as the reference (pass --no-reference)"
        )
    return model.eval()


def run_reference(
    hf_model,
    tokenizer,
    workload: Sequence[WorkloadRequest],
    batch_size: int = 1,
    equal_length: bool = False,
) -> dict:
    """Greedy `generate` over the workload; latencies, throughput and the generated ids.
    `equal_length`: every request runs to its max_new_tokens, past end-of-sequence (as the
    bench's `--equal-length` engines do)."""
    import torch

    prompts = [r.token_ids(tokenizer) for r in workload]
    eos = list(tokenizer.eos_token_ids)
    pad = eos[0]
    records: list[dict] = []
    start = time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        group = range(first, min(first + batch_size, len(prompts)))
        width = max(len(prompts[i]) for i in group)
        ids = torch.tensor([[pad] * (width - len(prompts[i])) + prompts[i] for i in group])
        mask = torch.tensor(
            [[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in group]
        )
        new = max(workload[i].max_new_tokens for i in group)
        with torch.inference_mode():
            out = hf_model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                do_sample=False,
                # No id is -1: generation runs on past EOS (None would mean the model's own).
                eos_token_id=[-1] if equal_length else eos,
                pad_token_id=pad,
            )
        finished = time.perf_counter() - start
        for row, i in enumerate(group):
            stops = [] if equal_length else eos
            tokens = _until_stop(out[row, width:].tolist(), stops, workload[i].max_new_tokens)
            records.append(
                {
                    "end_to_end_latency": finished,
                    "generated_tokens": float(len(tokens)),
                    "token_ids": tokens,
                    "text": tokenizer.decode(tokens),
                }
            )
    makespan = time.perf_counter() - start
    return {
        "config": "transformers generate",
        "batch_size": batch_size,
        "makespan_s": makespan,
        "throughput_tok_s": sum(r["generated_tokens"] for r in records) / makespan,
        "requests": records,
    }


def _until_stop(tokens: list[int], eos: list[int], limit: int) -> list[int]:
    # generate pads rows that finished early and may run past a row's own limit in a batch.
    tokens = tokens[:limit]
    for k, token in enumerate(tokens):
        if token in eos:
            return tokens[: k + 1]
    return tokens
