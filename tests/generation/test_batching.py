"""Continuous batching (generation/batching.py): a sample's tokens depend on its seed, prompt and sample index only --
not on how many rows decode together, which neighbours it has or when they finish -- and equal the reference that
recomputes one padded batch at every step and looks for stop strings in the whole text; incremental stop strings
(generation/stops.py) answer exactly as the whole text does."""

from __future__ import annotations

import random

import pytest
import torch
from gen_helpers import ROPE, ragged_prompts, tiny_config

from codegeex_train.tokenization.tokenizer import default_tokenizer
from codegeex_train.generation import HUMANEVAL_STOP, Generator, SamplingParams
from codegeex_train.generation.stops import StopStrings
from codegeex_train.model import CodeGeeXModel

SAMPLED = SamplingParams(max_new_tokens=20, temperature=1.0, top_p=0.9, seed=5)
END_IDS = (22, 75, 93)  # ids this model samples often: rows end at many different lengths


@pytest.fixture(scope="module", params=["learned", "rope"])
def generator(request):
    config = tiny_config() if request.param == "learned" else tiny_config(**ROPE)
    return Generator(CodeGeeXModel(config, None, None, seed=3), None)


@pytest.mark.parametrize("params", [SAMPLED, SamplingParams(max_new_tokens=20)], ids=["sampled", "greedy"])
def test_a_sample_does_not_depend_on_its_batch(generator, params):
    prompts = ragged_prompts(100, (3, 11, 6, 1))
    n = 3
    reference = generator.generate_ids(prompts, params, num_samples=n, end_ids=END_IDS, use_cache=False)
    if not params.greedy:  # (greedy samples of a prompt are one sample n times)
        lengths = [len(r) for r in reference]
        assert len(set(lengths)) >= 4 and min(lengths) < params.max_new_tokens  # rows leave at different steps
    for batch_size in (1, 2, 5, None):  # alone, pairs, a refilled batch that then compacts, all at once
        assert generator.generate_ids(prompts, params, num_samples=n, end_ids=END_IDS,
                                      batch_size=batch_size) == reference, f"batch_size {batch_size}"
    # Prompt 0's samples without the other prompts: the same samples.
    alone = generator.generate_ids(prompts[:1], params, num_samples=n, end_ids=END_IDS, batch_size=1)
    assert alone == reference[:n]


def test_samples_are_reproducible_and_the_seed_matters(generator):
    prompts = ragged_prompts(100, (4, 9))
    first = generator.generate_ids(prompts, SAMPLED, num_samples=4)
    assert first == generator.generate_ids(prompts, SAMPLED, num_samples=4, batch_size=3)
    assert len({tuple(r) for r in first}) == len(first)  # every sample its own stream
    other = generator.generate_ids(prompts, SamplingParams(**{**vars(SAMPLED), "seed": 6}), num_samples=4)
    assert all(a != b for a, b in zip(first, other))


def test_stream_yields_every_sample_once_as_it_finishes(generator):
    prompts = ragged_prompts(100, (3, 11, 6))
    stream = list(generator.stream_ids(prompts, SAMPLED, num_samples=3, end_ids=END_IDS, batch_size=2))
    assert sorted(i for i, _ in stream) == list(range(9))
    assert [i for i, _ in stream] != list(range(9))  # finish order, not index order
    assert dict(stream) == dict(enumerate(generator.generate_ids(prompts, SAMPLED, num_samples=3, end_ids=END_IDS)))


def test_batching_arguments_are_checked(generator):
    with pytest.raises(ValueError, match="num_samples 0"):
        generator.generate_ids([[1]], SAMPLED, num_samples=0)
    with pytest.raises(ValueError, match="batch_size 0"):
        generator.generate_ids([[1]], SAMPLED, batch_size=0)


def test_incremental_stop_strings_answer_as_the_whole_text():
    """Random walks over the shipped tokenizer's ids (code, whitespace runs, multi-byte characters cut between
    byte tokens): after every token, the windowed check says what the whole-text check says, up to the first hit."""
    tokenizer = default_tokenizer()
    pieces = ["\n", "def", "    ", "é", "日本", "#", "class", "if", "print", "x", " = ", "(", "€"]
    piece_ids = sorted({i for p in pieces for i in tokenizer.encode(p)})  # multi-byte characters: several ids
    other_ids = list(range(256, 400))
    stops = HUMANEVAL_STOP + ("日本", "é€")

    def whole(prompt, ids):
        return tokenizer.decode(prompt + ids)[len(tokenizer.decode(prompt)):]

    checker = StopStrings(stops, whole, tokenizer.decode)
    rng, hits, long_hits = random.Random(0), 0, 0
    for walk in range(300):
        prompt, ids = tokenizer.encode("def f():"), []
        for _ in range(120):
            ids.append(rng.choice(piece_ids if rng.random() < 0.7 else other_ids))
            expected = any(s in whole(prompt, ids) for s in stops)
            assert checker.hit(prompt, ids) == expected, (walk, ids)
            if expected:
                hits += 1
                long_hits += len(ids) > checker.window
                break
    assert hits > 100 and long_hits > 10  # both the short path and the window were exercised


def test_slots_refuse_what_they_cannot_hold():
    model = CodeGeeXModel(tiny_config(), None, None, seed=1).eval()
    slots = model.new_kv_slots(2, 3, prefixes=1, prefix_capacity=4)
    cache = model.new_kv_cache(1, 5)
    with pytest.raises(ValueError, match="does not fit the 4 prefix positions"):
        slots.load_prefix(0, cache, 5)
    with pytest.raises(ValueError, match="rows = 0"):
        model(torch.tensor([[1]]), torch.tensor([[0]]), kv_cache=slots)
    slots.load_prefix(0, cache, 4)
    slots.attach(0, 0)
    slots.rows = 1
    for _ in range(3):
        model(torch.tensor([[1]]), slots.positions(), kv_cache=slots)
    with pytest.raises(ValueError, match="hold 3 positions"):
        model(torch.tensor([[1]]), slots.positions(), kv_cache=slots)
