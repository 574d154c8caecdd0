"""Decoding under grouped-query attention and a sliding window: the KV cache and KVSlots hold the key-value groups
(not the heads; the multi-head top query layer its heads), teacher-forced cached logits equal the full forward's
(itself checked against a dense reference in tests/model/test_attention_options.py), and greedy / sampled tokens
through continuous batching (KVSlots) equal the no-cache decoder's, at TP 1 here and TP 2 on the session's ranks."""

from __future__ import annotations

import torch
from gen_helpers import GQA_WINDOW, SAMPLING, cache_vs_full, max_err, ragged_prompts, tiny_config

from codegeex_train.generation import Generator, SamplingParams
from codegeex_train.model import CodeGeeXModel

TOL = 1e-5
GREEDY = SamplingParams(max_new_tokens=24)


def gqa_model(**overrides) -> CodeGeeXModel:
    return CodeGeeXModel(tiny_config(**{**GQA_WINDOW, **overrides}), None, None, seed=11).eval()


def test_cache_holds_groups():
    model = gqa_model()
    cache, slots = model.new_kv_cache(3, 7), model.new_kv_slots(4, 5, prefixes=2, prefix_capacity=6)
    # 2 layers of 2 groups of head dim 8, then the top query layer's 8 heads
    assert [tuple(k.shape) for k in cache.keys] == [(3, 2, 7, 8)] * 2 + [(3, 8, 7, 8)]
    assert [tuple(v.shape) for v in cache.values] == [(3, 2, 7, 8)] * 2 + [(3, 8, 7, 8)]
    assert [tuple(k.shape) for k in slots.keys] == [(4, 2, 5, 8)] * 2 + [(4, 8, 5, 8)]
    assert [tuple(k.shape) for k in slots.prefix_keys] == [(2, 2, 6, 8)] * 2 + [(2, 8, 6, 8)]
    no_top = gqa_model(top_query_layer=False)
    assert [tuple(k.shape) for k in no_top.new_kv_cache(1, 4).keys] == [(1, 2, 4, 8)] * 2


def test_cached_logits_equal_full_forward():
    """A left-padded prefill, a 2-token chunk, then single tokens, well past the window of 4."""
    result = cache_vs_full(gqa_model(), steps=10)
    assert max(result["errors"]) <= TOL, result["errors"]
    assert result["largest_logit"] > 1.0


def test_cache_without_the_window_fails():
    """The comparison can tell: a cache that ignores the window is far from the windowed full forward."""
    model = gqa_model()
    original = model.new_kv_cache

    def unwindowed(*args):
        cache = original(*args)
        cache.window = None
        return cache

    model.new_kv_cache = unwindowed
    assert max(cache_vs_full(model, steps=10)["errors"]) > 1e-2


@torch.no_grad()
def test_slots_logits_equal_full_forward():
    """KVSlots: two prompts as prefixes, three rows (two share a prompt, so a prefix serves a group of rows), each fed
    its own tokens past the window; every step's logits against the full forward of the row's whole sequence."""
    model = gqa_model()
    vocab = model.config.vocab_size
    prompts = ragged_prompts(vocab, (6, 3), seed=1)
    rows = [(0, ragged_prompts(vocab, (7,), seed=2)[0]), (1, ragged_prompts(vocab, (7,), seed=3)[0]),
            (0, ragged_prompts(vocab, (7,), seed=4)[0])]  # (prompt, its continuation)
    slots = model.new_kv_slots(3, 8, prefixes=2, prefix_capacity=6)
    for p, prompt in enumerate(prompts):
        cache = model.new_kv_cache(1, len(prompt))
        model(torch.tensor([prompt]), torch.arange(len(prompt))[None], kv_cache=cache)
        slots.load_prefix(p, cache, len(prompt))
    for r, (p, _) in enumerate(rows):
        slots.attach(r, p)
    slots.rows = len(rows)
    errors = []
    for step in range(7):
        tokens = torch.tensor([[cont[step]] for _, cont in rows])
        logits = model(tokens, slots.positions(), kv_cache=slots, gather_logits=True)[:, -1]  # (rows, v)
        for r, (p, cont) in enumerate(rows):
            seq = torch.tensor([prompts[p] + cont[:step + 1]])
            full = model(seq, torch.arange(seq.shape[1])[None], gather_logits=True)[0, -1]
            errors.append(max_err(logits[r], full))
    assert max(errors) <= TOL, errors


def test_generation_through_slots_equals_no_cache():
    gen = Generator(gqa_model(), None)
    prompts = ragged_prompts(100)
    assert gen.generate_ids(prompts, GREEDY) == gen.generate_ids(prompts, GREEDY, use_cache=False)
    # 3 samples a prompt through 2 slots: rows leave, others take their slots (KVSlots.move, attach)
    sampled = gen.generate_ids(prompts, SAMPLING, num_samples=3, batch_size=2, end_ids=(7, 9, 11))
    assert sampled == gen.generate_ids(prompts, SAMPLING, num_samples=3, use_cache=False, end_ids=(7, 9, 11))


def test_tp2_caches_groups_and_decodes_as_without_cache(tp2_results):
    for rank, result in enumerate(tp2_results):
        # TP 2: one of the 2 groups per rank in each layer, 4 of the 8 heads in the top query layer
        assert [tuple(s) for s in result["gqa_cache_shapes"]] == [(2, 1, 5, 8)] * 2 + [(2, 4, 5, 8)], rank
        assert max(result["cache_gqa_window"]["errors"]) <= TOL, (rank, result["cache_gqa_window"]["errors"])
        assert result["gqa_greedy"] == result["gqa_greedy_no_cache"], rank
    tp1 = Generator(gqa_model(), None)
    assert tp2_results[0]["gqa_greedy"] == tp1.generate_ids(ragged_prompts(100), SamplingParams(max_new_tokens=40))
