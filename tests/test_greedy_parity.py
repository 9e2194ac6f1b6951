"""Greedy continuations of the real SmolLM2 equal transformers `generate` token for token."""

from __future__ import annotations

import torch

import etjax

NUM_PROMPTS = 6
NEW_TOKENS = 32


def _prompts(lee: list[str]) -> list[str]:
    # Opening sentences of several articles, of different lengths, so the batch mixes lengths.
    return [" ".join(lee[i].split()[: 12 + 9 * i]) for i in range(NUM_PROMPTS)]


def test_greedy_continuations_match_transformers(smollm2, hf_smollm2, lee):
    prompts = _prompts(lee)
    results = etjax.decode(prompts, model=smollm2, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    for prompt, result in zip(prompts, results, strict=True):
        ids = torch.tensor([result.prompt_token_ids])
        with torch.no_grad():
            reference = hf_smollm2.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
            )[0, ids.shape[1] :].tolist()
        assert result.token_ids == reference, prompt
        assert result.text == smollm2.tokenizer.decode(reference)
        assert result.finish_reason == "length"
