"""Sampling: top-k / top-p masks on hand-made distributions, the sampler's statistics, seeded reproducibility
(TP 1 and on every rank of TP 2), padded vocabulary ids never chosen, parameter checks."""

from __future__ import annotations

import math

import pytest
import torch
from gen_helpers import SAMPLING, tiny_config

from codegeex_train.generation import Generator, SamplingParams, sample_next_tokens, top_k_mask, top_p_mask
from codegeex_train.model import CodeGeeXModel

PROBS = torch.tensor([[0.05, 0.5, 0.15, 0.3]])  # sorted: 1 (0.5), 3 (0.3), 2 (0.15), 0 (0.05)
LOGITS = PROBS.log()


def kept(mask: torch.Tensor) -> list[int]:
    return (~mask[0]).nonzero().flatten().tolist()


@pytest.mark.parametrize("k, expected", [(1, [1]), (2, [1, 3]), (3, [1, 2, 3]), (4, [0, 1, 2, 3]), (9, [0, 1, 2, 3])])
def test_top_k_mask(k, expected):
    assert kept(top_k_mask(LOGITS, k)) == expected


def test_top_k_keeps_ties():
    assert kept(top_k_mask(torch.tensor([[1.0, 3.0, 3.0, 0.0]]), 1)) == [1, 2]


@pytest.mark.parametrize("p, expected", [
    (0.3, [1]),            # the most likely token alone reaches 0.3
    (0.45, [1]),
    (0.6, [1, 3]),         # 0.5 < 0.6 <= 0.8
    (0.79, [1, 3]),
    (0.9, [1, 2, 3]),      # 0.8 < 0.9 <= 0.95
    (0.99, [0, 1, 2, 3]),
    (1e-6, [1]),           # never empty
])
def test_top_p_mask(p, expected):
    assert kept(top_p_mask(LOGITS, p)) == expected


def test_top_p_per_row():
    logits = torch.stack([LOGITS[0], torch.tensor([0.7, 0.1, 0.1, 0.1]).log()])
    mask = top_p_mask(logits, 0.6)
    assert (~mask).tolist() == [[False, True, False, True], [True, False, False, False]]


def test_sampler_statistics():
    """top_k=3 then top_p=0.9 on PROBS leaves {1, 3, 2} renormalised; temperature sharpens as exp(logit / T)."""
    logits = LOGITS.expand(20000, 4)
    g = torch.Generator().manual_seed(0)
    draws = sample_next_tokens(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.9), g)
    freq = torch.bincount(draws, minlength=4).double() / len(draws)
    expected = torch.tensor([0.0, 0.5, 0.15, 0.3], dtype=torch.double) / 0.95
    assert freq[0] == 0 and (freq - expected).abs().max() < 0.015
    draws = sample_next_tokens(logits, SamplingParams(temperature=0.5), g)
    freq = torch.bincount(draws, minlength=4).double() / len(draws)
    sharp = PROBS[0].double() ** 2 / (PROBS[0].double() ** 2).sum()
    assert (freq - sharp).abs().max() < 0.015


def test_greedy_is_argmax_and_ignores_filters():
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [5.0, 0.0, 0.0, 0.0]])
    assert sample_next_tokens(logits, SamplingParams(top_k=1, top_p=0.1)).tolist() == [1, 0]  # first of a tie


@pytest.mark.parametrize("kwargs, flag", [
    ({"temperature": -1.0}, "--temperature"), ({"temperature": math.nan}, "--temperature"),
    ({"top_k": -1}, "--top-k"), ({"top_p": 0.0}, "--top-p"), ({"top_p": 1.5}, "--top-p"),
    ({"max_new_tokens": -1}, "--max-new-tokens"), ({"stop": ("",)}, "--stop"),
])
def test_params_are_checked(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        SamplingParams(**kwargs)


def test_stop_string_alone_becomes_a_tuple():
    assert SamplingParams(stop="\ndef").stop == ("\ndef",)


@pytest.fixture(scope="module")
def tiny_generator():
    return Generator(CodeGeeXModel(tiny_config(), None, None, seed=3), None)


def test_seeded_sampling_is_reproducible(tiny_generator):
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    first = tiny_generator.generate_ids(prompts, SAMPLING)
    assert first == tiny_generator.generate_ids(prompts, SAMPLING)
    assert first == tiny_generator.generate_ids(prompts, SAMPLING, use_cache=False)
    other = tiny_generator.generate_ids(prompts, SamplingParams(**{**vars(SAMPLING), "seed": 8}))
    assert other != first
    assert all(len(row) == SAMPLING.max_new_tokens for row in first)


def test_padded_vocabulary_is_never_sampled(tiny_generator):
    """vocab 100 padded to 128: rows 100..127 exist in the table but are no tokens."""
    with torch.no_grad():
        tiny_generator.model.word_embeddings.weight[100:] = 10.0  # would win every argmax if not masked
    try:
        ids = tiny_generator.generate_ids([[1, 2]], SamplingParams(max_new_tokens=8, temperature=5.0))[0]
        ids += tiny_generator.generate_ids([[1, 2]], SamplingParams(max_new_tokens=8))[0]
    finally:
        with torch.no_grad():
            tiny_generator.model.word_embeddings.weight[100:] = 0.0
    assert ids and max(ids) < 100


def test_sampling_identical_on_every_tp_rank(tp2_results):
    first = tp2_results[0]["sampled"]
    assert all(len(row) == SAMPLING.max_new_tokens for row in first)
    assert len({tuple(map(tuple, r["sampled"])) for r in tp2_results}) == 1  # every rank, the same tokens
    assert all(r["sampled_again"] == first for r in tp2_results)  # and again with the same seed
    assert first != tp2_results[0]["greedy"]


def test_prompts_are_checked(tiny_generator):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        tiny_generator.generate_ids([[1], []], SamplingParams())
    with pytest.raises(ValueError, match="token id 100"):
        tiny_generator.generate_ids([[1, 100]], SamplingParams())
    with pytest.raises(ValueError, match="exceeds the model's 64 positions"):
        tiny_generator.generate_ids([[1] * 65], SamplingParams())
    with pytest.warns(UserWarning, match="max_new_tokens 128 cut to 5"):
        out = tiny_generator.generate_ids([[1] * 60, [2]], SamplingParams(max_new_tokens=128))
    assert [len(r) for r in out] == [5, 5]
    assert tiny_generator.generate_ids([[1]], SamplingParams(max_new_tokens=0)) == [[]]
    assert tiny_generator.generate_ids([], SamplingParams()) == []
