"""Greedy decoding against Hugging Face: a random GPT-2 converted to our layout generates the same 64 tokens as
``GPT2LMHeadModel.generate(do_sample=False)`` for every prompt of a ragged batch; TP 2 the same tokens as TP 1."""

from __future__ import annotations

import pytest
import torch
from gen_helpers import NEW_TOKENS, PROMPT_LENGTHS

from codegeex_train.generation import Generator, SamplingParams

GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS)


@pytest.fixture(scope="module")
def hf_tokens(hf_gpt2):
    """HF's greedy continuation of each prompt, alone (no padding to get wrong)."""
    out = []
    for prompt in hf_gpt2["prompts"]:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            generated = hf_gpt2["hf_model"].generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                                     max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        out.append(generated[0, len(prompt):].tolist())
    return out


@pytest.fixture(scope="module")
def tp1(hf_gpt2):
    return Generator.from_checkpoint(hf_gpt2["ckpt"][1], None)


def test_greedy_batch_matches_hf_generate(tp1, hf_gpt2, hf_tokens):
    assert sorted(map(len, hf_gpt2["prompts"])) == sorted(PROMPT_LENGTHS) and len(set(PROMPT_LENGTHS)) > 1
    assert all(len(t) == NEW_TOKENS for t in hf_tokens)
    assert all(len(set(t)) >= 5 for t in hf_tokens)  # the continuations do not collapse into one token
    ours = tp1.generate_ids(hf_gpt2["prompts"], GREEDY)  # one left-padded batch
    assert ours == hf_tokens


@pytest.mark.slow
def test_greedy_alone_and_without_cache_match(tp1, hf_gpt2, hf_tokens):
    prompts = hf_gpt2["prompts"]
    assert [tp1.generate_ids([p], GREEDY)[0] for p in prompts] == hf_tokens
    assert tp1.generate_ids(prompts, GREEDY, use_cache=False) == hf_tokens


def test_tp2_greedy_matches_tp1(tp2_results, tp1, hf_gpt2, hf_tokens):
    assert tp1.generate_ids(hf_gpt2["prompts"], GREEDY) == hf_tokens
    for result in tp2_results:
        assert result["greedy"] == hf_tokens
