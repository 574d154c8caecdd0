"""Incremental decoding with the KV cache computes the full forward's logits at every step (fp32, <= 1e-5), at
TP 1 and TP 2 (real gloo ranks), with and without the top query layer, with learned and rotary positions; greedy
decoding of a RoPE model with the cache gives the tokens of recomputing every step; and the cache's bookkeeping."""

from __future__ import annotations

import pytest
import torch
from gen_helpers import ROPE, cache_vs_full, max_err, ragged_prompts, tiny_config

from codegeex_train.generation import Generator, SamplingParams
from codegeex_train.model import CodeGeeXModel

TOL = 1e-5


@pytest.mark.parametrize("top_query", [True, False])
def test_cached_logits_equal_full_forward_tp1(top_query):
    result = cache_vs_full(CodeGeeXModel(tiny_config(top_query_layer=top_query), None, None, seed=11))
    assert result["largest_logit"] > 1.0  # logits far from zero, so the comparison means something
    assert len(result["errors"]) == 10 and result["cached"] == 9 + 2 + 8
    assert max(result["errors"]) <= TOL, result["errors"]


@pytest.mark.slow
@pytest.mark.parametrize("top_query", [True, False])
def test_cached_logits_equal_full_forward_tp2(tp2_results, top_query):
    for rank, result in enumerate(tp2_results):
        r = result[f"cache_top_query_{top_query}"]
        assert r["largest_logit"] > 1.0
        assert max(r["errors"]) <= TOL, (rank, r["errors"])


@pytest.mark.parametrize("top_query", [True, False])
def test_rope_cached_logits_equal_full_forward_tp1(top_query):
    """Each step's keys are turned by their own positions before the cache stores them (ragged rows: the
    positions of a left-padded row start at its first real token)."""
    result = cache_vs_full(CodeGeeXModel(tiny_config(**ROPE, top_query_layer=top_query), None, None, seed=11))
    assert result["largest_logit"] > 1.0 and len(result["errors"]) == 10
    assert max(result["errors"]) <= TOL, result["errors"]


def test_rope_greedy_with_cache_equals_recomputing():
    model = CodeGeeXModel(tiny_config(**ROPE), None, None, seed=11)
    gen, greedy = Generator(model, None), SamplingParams(max_new_tokens=40)
    prompts = ragged_prompts(100)
    cached = gen.generate_ids(prompts, greedy)
    # Tiny random models fall into loops: these rows still hold 6 distinct tokens between them
    assert all(len(t) == 40 for t in cached) and len(set(sum(cached, []))) >= 5
    assert cached == gen.generate_ids(prompts, greedy, use_cache=False)


def test_rope_tp2_caches_and_decodes_as_tp1(tp2_results):
    tp1 = Generator(CodeGeeXModel(tiny_config(**ROPE), None, None, seed=11), None)
    expected = tp1.generate_ids(ragged_prompts(100), SamplingParams(max_new_tokens=40))
    for rank, result in enumerate(tp2_results):
        assert max(result["cache_rope"]["errors"]) <= TOL, (rank, result["cache_rope"]["errors"])
        assert result["rope_greedy"] == result["rope_greedy_no_cache"] == expected, rank


def test_top_query_layer_is_cached():
    """The cache has one slot per layer plus the top query layer's, and decoding writes into all of them."""
    model = CodeGeeXModel(tiny_config(), None, None, seed=11).eval()
    cache = model.new_kv_cache(batch_size=2, capacity=6)
    assert [k.shape for k in cache.keys] == [(2, 4, 6, 8)] * 3  # layers + top query: (b, heads, capacity, head dim)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.arange(3).expand(2, 3), kv_cache=cache)
    assert cache.length == 3
    assert all(cache.keys[i][:, :, :3].abs().sum() > 0 for i in range(3))
    assert all(k[:, :, 3:].abs().sum() == 0 for k in cache.keys)
    no_top = CodeGeeXModel(tiny_config(top_query_layer=False), None, None, seed=11)
    assert len(no_top.new_kv_cache(1, 4).keys) == 2


def test_cache_refuses_overflow_and_misuse():
    model = CodeGeeXModel(tiny_config(), None, None, seed=11).eval()
    ids, pos = torch.tensor([[1, 2, 3]]), torch.arange(3)[None]
    with pytest.raises(ValueError, match="KV cache holds 2 positions"):
        model(ids, pos, kv_cache=model.new_kv_cache(1, 2))
    with pytest.raises(ValueError, match="attention_mask needs kv_cache"):
        model(ids, pos, attention_mask=torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="labels"):
        model(ids, pos, labels=ids, kv_cache=model.new_kv_cache(1, 3))


def _dense_logits():
    """tests/model's dense reference forward (plain float64 torch, written independently of the model)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "model" / "model_helpers.py"
    spec = importlib.util.spec_from_file_location("model_helpers_for_cache_tests", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.dense_logits


@torch.no_grad()
def test_last_token_only_and_training_path_unchanged():
    """last_token_only returns the last position's logits; the training path (no cache) gives the dense
    reference's logits (float64 model, <= 1e-9) and loss (computed in fp32, <= 1e-6), the same bit for bit after
    the model has decoded with a cache, and a prefill through a fresh cache gives the same logits."""
    config = tiny_config()
    model = CodeGeeXModel(config, None, None, seed=11, dtype=torch.float64).eval()
    g = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(0, 100, (2, 12), generator=g), torch.randint(0, 100, (2, 12), generator=g)
    pos = torch.arange(12).expand(2, 12)
    expected = _dense_logits()(dict(model.named_parameters()), config, ids, pos)  # (2, 12, 128)
    expected_loss = torch.nn.functional.cross_entropy(expected.flatten(0, 1), labels.flatten(), reduction="none")

    full = model(ids, pos)
    loss = model(ids, pos, labels=labels)
    assert full.shape == expected.shape and full.abs().max() > 1.0
    assert max_err(full, expected) <= 1e-9
    assert loss.shape == (2, 12) and max_err(loss, expected_loss.view(2, 12)) <= 1e-6
    assert model(ids, pos, last_token_only=True).shape == (2, 1, 128)
    assert max_err(model(ids, pos, last_token_only=True), full[:, -1:]) <= 1e-12

    cache = model.new_kv_cache(batch_size=2, capacity=32)  # decode: a 3-token prefill, then one token
    model(ids[:, :3], pos[:, :3], kv_cache=cache)
    model(ids[:, 3:4], pos[:, 3:4], kv_cache=cache)
    assert torch.equal(model(ids, pos), full)  # the cache left the training path untouched
    assert torch.equal(model(ids, pos, labels=labels), loss)
    prefill = model(ids, pos, kv_cache=model.new_kv_cache(batch_size=2, capacity=12))
    assert max_err(prefill, expected) <= 1e-9


def test_pipeline_stages_are_refused(tmp_path):
    from codegeex_train.checkpoint import CheckpointError, save_model_checkpoint
    from codegeex_train.checkpoint.sharding import split_model_parallel
    from codegeex_train.generation import Generator

    config = tiny_config()
    stage = CodeGeeXModel(config, None, None, post_process=False, layer_numbers=range(1))
    with pytest.raises(ValueError, match="gather to PP 1 with tools/convert_checkpoint.py"):
        Generator(stage, None)
    full = CodeGeeXModel(config, None, None, seed=1).state_dict()
    save_model_checkpoint(tmp_path, split_model_parallel(full, config, 1, [range(1), range(1, 2)]), config, 1,
                          pp_size=2)
    with pytest.raises(CheckpointError, match="x PP 2; generation runs the whole model.*gather to PP 1 with tools/convert_checkpoint.py"):
        Generator.from_checkpoint(tmp_path, None)
