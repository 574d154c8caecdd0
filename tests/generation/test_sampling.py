"""Sampling: top-k / top-p masks on hand-made distributions, the kept set of temperature + top-k + top-p against an
independent reference (where each filter alone keeps a different set), the sampler's statistics, seeded
reproducibility (TP 1 and on every rank of TP 2), padded vocabulary ids never chosen, parameter checks."""

from __future__ import annotations

import math

import pytest
import torch
from gen_helpers import SAMPLING, tiny_config

from codegeex_train.generation import Generator, SamplingParams, sample_next_tokens, top_k_mask, top_p_mask
from codegeex_train.generation.sampling import choose_tokens, filtered_scores
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


def test_top_p_keeps_ties():
    """The least likely token of the nucleus brings its ties along (as top-k does)."""
    assert kept(top_p_mask(torch.tensor([[0.3, 0.4, 0.3]]).log(), 0.5)) == [0, 1, 2]
    assert kept(top_p_mask(torch.tensor([[0.3, 0.4, 0.3]]).log(), 0.4)) == [1]


def reference_nucleus(scores: torch.Tensor, p: float) -> torch.Tensor:
    """Kept mask by a full sort of each row alone, in float64 plain Python order: the fewest most likely tokens
    reaching p, with the ties of the least likely of them."""
    out = torch.zeros_like(scores, dtype=torch.bool)
    for i, row in enumerate(torch.softmax(scores, dim=-1)):
        ranked = sorted(row.tolist(), reverse=True)
        running = torch.tensor(ranked).cumsum(0)  # float32 running sums, as the mask's
        reached = (running >= p).nonzero()
        floor = ranked[int(reached[0]) if len(reached) else -1]
        out[i] = row >= floor
    return out


@pytest.mark.parametrize("p", [0.5, 0.95])
def test_top_p_wide_and_narrow_rows(p):
    """Rows whose nucleus is far wider than the first look's candidates (flat rows) and narrow ones (peaked) in
    one batch, with ties: each row's kept set is the full sort's, and the same as the row's alone."""
    g = torch.Generator().manual_seed(3)
    v = 3000
    flat = torch.randn(6, v, generator=g) * 0.1
    peaked = torch.randn(6, v, generator=g) * 6.0
    peaked[:, :4] = peaked[:, :4].max(dim=-1, keepdim=True).values  # ties at the top
    scores = torch.cat([flat, peaked])[torch.randperm(12, generator=g)]
    scores = (scores * 64).round() / 64  # more ties everywhere
    mask = top_p_mask(scores, p)
    widths = (~mask).sum(dim=-1)
    assert widths.max() > 500 and widths.min() < 64  # both paths are taken
    assert torch.equal(~mask, reference_nucleus(scores, p))
    for i in range(len(scores)):
        assert torch.equal(top_p_mask(scores[i:i + 1], p), mask[i:i + 1])


def full_vocabulary_draw(logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor) -> torch.Tensor:
    """The inverse CDF over every id of the vocabulary (no gathering), row by row."""
    probs = torch.softmax(filtered_scores(logits, params), dim=-1)
    cdf = probs.double().cumsum(dim=-1)
    out = []
    for row_probs, row_cdf, u in zip(probs, cdf, uniforms.tolist()):
        i = int(torch.searchsorted(row_cdf, torch.tensor([u], dtype=torch.float64) * row_cdf[-1], right=True))
        last = int((row_probs > 0).nonzero().max())
        out.append(min(i, last))
    return torch.tensor(out)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8, top_p=0.95),
                                    SamplingParams(temperature=1.3, top_k=40),
                                    SamplingParams(temperature=0.5, top_k=300, top_p=0.9),
                                    SamplingParams(temperature=1.0)])
def test_choose_tokens_equals_full_vocabulary_draw(params):
    """Gathering the kept ids before the running sum changes no draw: against the running sum over every id, on
    rows of very different widths, with uniforms at 0 and next to 1."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(40, 2000, generator=g) * torch.linspace(0.05, 8.0, 40)[:, None]
    logits = (logits * 16).round() / 16
    uniforms = torch.rand(40, generator=g, dtype=torch.float64)
    uniforms[:3] = torch.tensor([0.0, 1.0 - 2 ** -53, 0.5], dtype=torch.float64)
    chosen = choose_tokens(logits, params, uniforms)
    assert torch.equal(chosen, full_vocabulary_draw(logits, params, uniforms))
    for i in range(0, 40, 7):  # a row alone draws what it draws in the batch
        assert torch.equal(choose_tokens(logits[i:i + 1], params, uniforms[i:i + 1]), chosen[i:i + 1])


# Eight tokens without ties, sorted: 1 (0.34), 5 (0.25), 3 (0.16), 4 (0.08), 7 (0.06), 0 (0.05), 2 (0.04), 6 (0.02).
# On it top-k 3 alone and top-p 0.7 alone both keep {1, 5, 3}, but together (top-p over the renormalised top 3)
# only {1, 5}; and temperature changes which tokens top-p keeps: a filter dropped, or temperature applied after
# the filters, changes the kept set.
WIDE = [0.05, 0.34, 0.04, 0.16, 0.08, 0.25, 0.02, 0.06]


def reference_distribution(probs: list[float], temperature: float, top_k: int, top_p: float) -> dict[int, float]:
    """Hugging Face's order in plain Python: p ** (1 / T) renormalised, keep the k most likely, renormalise, keep
    the smallest most-likely prefix whose probability reaches top_p, renormalise. {token: probability}."""
    weights = {i: p ** (1.0 / temperature) for i, p in enumerate(probs)}
    ranked = sorted(weights, key=weights.get, reverse=True)
    if top_k > 0:
        ranked = ranked[:top_k]
    total = sum(weights[i] for i in ranked)
    nucleus, mass = [], 0.0
    for i in ranked:
        if nucleus and mass >= top_p:
            break
        nucleus.append(i)
        mass += weights[i] / total
    total = sum(weights[i] for i in nucleus)
    return {i: weights[i] / total for i in nucleus}


@pytest.mark.parametrize("temperature, top_k, top_p, expected", [
    (1.0, 3, 1.0, [1, 3, 5]),        # top-k alone
    (1.0, 0, 0.7, [1, 3, 5]),        # top-p alone: 0.59 < 0.7
    (1.0, 3, 0.7, [1, 5]),           # both: within the top 3, 1 and 5 already hold 0.59 / 0.75 = 0.79 >= 0.7
    (2.0, 0, 0.7, [1, 3, 4, 5, 7]),  # flatter: top-p needs more tokens than at T = 1
    (0.5, 0, 0.7, [1, 5]),           # sharper: fewer
    (2.0, 6, 0.7, [1, 3, 4, 5]),     # all three differ from any two of them
])
def test_kept_set_matches_reference(temperature, top_k, top_p, expected):
    """Temperature first, then top-k, then top-p: the finite scores are exactly the reference's tokens."""
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    scores = filtered_scores(torch.tensor([WIDE]).log(), params)[0]
    assert scores.isfinite().nonzero().flatten().tolist() == expected
    assert sorted(reference_distribution(WIDE, temperature, top_k, top_p)) == expected


def frequencies(draws: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(draws, minlength=vocab).double() / len(draws)


def test_sampler_statistics():
    """top_k=3 then top_p=0.7 on WIDE leaves {1, 5} renormalised (each filter alone would keep token 3 too);
    temperature sharpens as exp(logit / T)."""
    logits = torch.tensor([WIDE]).log().expand(20000, 8)
    g = torch.Generator().manual_seed(0)
    freq = frequencies(sample_next_tokens(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.7), g), 8)
    expected = torch.tensor([0.0, 0.34, 0.0, 0.0, 0.0, 0.25, 0.0, 0.0], dtype=torch.double) / 0.59
    assert freq[expected == 0].sum() == 0 and (freq - expected).abs().max() < 0.015
    draws = sample_next_tokens(LOGITS.expand(20000, 4), SamplingParams(temperature=0.5), g)
    freq = frequencies(draws, 4)
    sharp = PROBS[0].double() ** 2 / (PROBS[0].double() ** 2).sum()
    assert (freq - sharp).abs().max() < 0.015


def test_top_p_with_temperature_statistics():
    """Temperature 2, top_k=6, top_p=0.7 on WIDE: the draws follow the reference distribution (tokens 1, 5, 3, 4
    with probability proportional to sqrt(p)); no other token is ever drawn."""
    logits = torch.tensor([WIDE]).log().expand(40000, 8)
    g = torch.Generator().manual_seed(1)
    freq = frequencies(sample_next_tokens(logits, SamplingParams(temperature=2.0, top_k=6, top_p=0.7), g), 8)
    reference = reference_distribution(WIDE, 2.0, 6, 0.7)
    expected = torch.tensor([reference.get(i, 0.0) for i in range(8)], dtype=torch.double)
    assert sorted(reference) == [1, 3, 4, 5]
    assert freq[expected == 0].sum() == 0, f"drawn outside the kept set: {freq.tolist()}"
    assert (freq - expected).abs().max() < 0.012, f"{freq.tolist()} vs {expected.tolist()}"


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
    # continuous batching at TP 2: every rank batches alike, and the slots do not change a sample
    slots = tp2_results[0]["sampled_slots"]
    assert all(r["sampled_slots"] == slots and r["sampled_all"] == slots for r in tp2_results)
    assert len({len(row) for row in slots}) > 1  # rows left the batch at different steps


def test_tp2_samples_as_tp1(tp2_results, hf_gpt2):
    """The same checkpoint at TP 1: the same samples (each rank's logits equal TP 1's to float rounding, and every
    sample draws from its own stream)."""
    tp1 = Generator.from_checkpoint(hf_gpt2["ckpt"][1], None)
    prompts = hf_gpt2["prompts"]
    assert tp1.generate_ids(prompts, SAMPLING) == tp2_results[0]["sampled"]
    assert tp1.generate_ids(prompts, SAMPLING, num_samples=3, end_ids=(7, 9, 11)) == tp2_results[0]["sampled_slots"]


def test_prompts_are_checked(tiny_generator):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        tiny_generator.generate_ids([[1], []], SamplingParams())
    with pytest.raises(ValueError, match="token id 100"):
        tiny_generator.generate_ids([[1, 100]], SamplingParams())
    with pytest.raises(ValueError, match="exceeds the model's 64 positions"):
        tiny_generator.generate_ids([[1] * 65], SamplingParams())
    with pytest.warns(UserWarning, match="max_new_tokens 128 cut to 5"):
        out = tiny_generator.generate_ids([[1] * 60, [2]], SamplingParams(max_new_tokens=128))
    assert [len(r) for r in out] == [5, 64]  # each prompt to its own limit: [2] has 63 positions left
    assert tiny_generator.generate_ids([[1]], SamplingParams(max_new_tokens=0)) == [[]]
    assert tiny_generator.generate_ids([], SamplingParams()) == []
