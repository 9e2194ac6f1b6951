"""Greedy continuations of the real SmolLM2 equal transformers' greedy search token for token."""

from __future__ import annotations

import torch

import etjax
from tests.greedy_reference import greedy_choices

NUM_PROMPTS = 6
NEW_TOKENS = 32


def _prompts(lee: list[str]) -> list[str]:
    # Opening sentences of several articles, of different lengths, so the batch mixes lengths.
    return [" ".join(lee[i].split()[: 12 + 9 * i]) for i in range(NUM_PROMPTS)]


def test_greedy_continuations_match_transformers(smollm2, hf_smollm2, lee):
    prompts = _prompts(lee)
    results = etjax.decode(prompts, model=smollm2, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    for prompt, result in zip(prompts, results, strict=True):
        # transformers' greedy `generate` in one pass: each of etjax's 32 tokens must be the
        # argmax of transformers' logits after the prompt and the tokens before it (so, by
        # induction, the sequence `generate` makes). One teacher-forced pass per prompt
        # instead of 32 steps of `generate`: 1.4 s for the six against 12.7 s. Only the
        # positions that predict the 32 get the LM head (tests/greedy_reference.py).
        reference = greedy_choices(hf_smollm2, result.prompt_token_ids, result.token_ids)
        assert len(reference) == NEW_TOKENS
        assert result.token_ids == reference, prompt
        assert result.text == smollm2.tokenizer.decode(reference)
        assert result.finish_reason == "length"


def test_top_and_prompt_logprobs_match_transformers_log_softmax(smollm2, hf_smollm2, lee):
    # The top-k at each greedy token, and each prompt token's log-probability, against
    # log_softmax of transformers' logits over the same tokens (one teacher-forced pass over
    # prompt + output). The greedy test's batch: its programs serve (one prompt alone took a
    # prefill and a burst of its own, two compiles, 5.2 of the test's 10.3 CPU s).
    k, new_tokens = 5, 8
    prompts = _prompts(lee)
    results = etjax.decode(
        prompts,
        model=smollm2,
        max_new_tokens=new_tokens,
        ignore_eos=True,
        logprobs=k,
        prompt_logprobs=True,
    )
    for result in results:
        ids = torch.tensor([result.prompt_token_ids + result.token_ids])
        with torch.no_grad():
            logits = hf_smollm2(ids).logits[0].float()
        start = len(result.prompt_token_ids) - 1
        prompt = torch.log_softmax(logits[:start], dim=-1)
        prompt = prompt[torch.arange(start), ids[0, 1 : start + 1]]
        assert result.prompt_logprobs[0] is None
        torch.testing.assert_close(
            torch.tensor(result.prompt_logprobs[1:]), prompt, atol=1e-4, rtol=0
        )
        reference = torch.log_softmax(logits[start : start + new_tokens], dim=-1)
        top_values, top_ids = torch.topk(reference, k, dim=-1)
        assert len(result.top_logprobs) == new_tokens
        for i, pairs in enumerate(result.top_logprobs):
            ours_ids = [t for t, _ in pairs]
            ours = torch.tensor([v for _, v in pairs])
            assert ours_ids[0] == result.token_ids[i]  # greedy: the drawn token is the first
            torch.testing.assert_close(ours, top_values[i], atol=1e-4, rtol=0)
            torch.testing.assert_close(ours, reference[i, ours_ids], atol=1e-4, rtol=0)
            assert ours_ids == top_ids[i].tolist()
