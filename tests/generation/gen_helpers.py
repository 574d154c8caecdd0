"""Shared pieces of the generation tests: tiny models, ragged prompts, the cache-vs-full-forward check, and the
work each spawned TP rank does."""

from __future__ import annotations

import torch

from codegeex_train.generation import Generator, SamplingParams
from codegeex_train.model import CodeGeeXModel, ModelConfig, ModelGroups

NEW_TOKENS = 64  # the HF parity length
PROMPT_LENGTHS = (3, 11, 6)
SAMPLING = SamplingParams(max_new_tokens=24, temperature=1.0, top_k=40, top_p=0.9, seed=7)
ROPE = {"position_embedding_type": "rope", "rotary_percent": 0.5}  # a RoPE model for tiny_config
# Grouped-query attention (8 heads, 2 key-value groups), a window of 4 (shorter than the prompts), Llama 3's RoPE
# scaling
GQA_WINDOW = {"hidden_size": 64, "num_attention_heads": 8, "group_query_attention": True, "num_query_groups": 2,
              "window_size": 4, "position_embedding_type": "rope", "rope_scaling": "llama3",
              "rope_scaling_factor": 4.0, "rope_original_max_position_embeddings": 8,
              "init_method_std": 0.1}  # logits of a few units: the tolerance is absolute


def tiny_config(**overrides) -> ModelConfig:
    fields = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=100, max_position_embeddings=64,
                  make_vocab_size_divisible_by=128, hidden_dropout=0.0, attention_dropout=0.0,
                  activation="fast_gelu", top_query_layer=True, init_method_std=0.2)
    fields.update(overrides)
    return ModelConfig(**fields)


def ragged_prompts(vocab: int, lengths=PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


@torch.no_grad()
def cache_vs_full(model: CodeGeeXModel, steps: int = 8, seed: int = 0) -> dict:
    """Teacher-force ragged sequences through the cache (a left-padded prefill, a 2-token chunk, then one token
    per step) and compare every logit with a full, unpadded forward of each row's prefix."""
    model.eval()
    vocab = model.config.vocab_size
    lengths = (5, 9, 2)
    seqs = [torch.tensor(p) for p in ragged_prompts(vocab, [n + steps + 2 for n in lengths], seed)]
    b, width = len(lengths), max(lengths)
    tokens = torch.zeros(b, width, dtype=torch.long)
    real = torch.zeros(b, width, dtype=torch.bool)
    for i, n in enumerate(lengths):
        tokens[i, width - n:], real[i, width - n:] = seqs[i][:n], True
    positions = (real.long().cumsum(-1) - 1).clamp(min=0)
    cache = model.new_kv_cache(b, width + steps + 2)

    def full(i: int, n: int) -> torch.Tensor:  # (n, v): row i's first n tokens, alone
        return model(seqs[i][None, :n], torch.arange(n)[None], gather_logits=True)[0]

    errors, largest = [], 0.0
    logits = model(tokens, positions, kv_cache=cache, attention_mask=real, gather_logits=True)  # (b, width, v)
    errors.append(max(max_err(logits[i, width - n:], full(i, n)) for i, n in enumerate(lengths)))
    largest = max(largest, logits.abs().max().item())
    done = list(lengths)
    for chunk in [2] + [1] * steps:  # a multi-token step, then single tokens
        new = torch.stack([seqs[i][n:n + chunk] for i, n in enumerate(done)])  # (b, chunk)
        pos = torch.stack([torch.arange(n, n + chunk) for n in done])
        logits = model(new, pos, kv_cache=cache, gather_logits=True)  # (b, chunk, v)
        done = [n + chunk for n in done]
        errors.append(max(max_err(logits[i], full(i, n)[-chunk:]) for i, n in enumerate(done)))
        largest = max(largest, logits.abs().max().item())
    return {"errors": errors, "largest_logit": largest, "cached": cache.length}


def tp_rank_checks(topology, ckpt_dir: str, prompts: list[list[int]]) -> dict:
    """On each rank of a TP group: cached vs full logits of random models (with and without the top query
    layer; a RoPE one, also decoded greedily with and without the cache), greedy and seeded sampling from a
    converted checkpoint."""
    out = {}
    for top_query in (True, False):
        model = CodeGeeXModel(tiny_config(top_query_layer=top_query), ModelGroups.from_topology(topology), seed=11)
        out[f"cache_top_query_{top_query}"] = cache_vs_full(model)
    rope = Generator(CodeGeeXModel(tiny_config(**ROPE), ModelGroups.from_topology(topology), seed=11), None)
    out["cache_rope"] = cache_vs_full(rope.model)
    greedy = SamplingParams(max_new_tokens=40)
    out["rope_greedy"] = rope.generate_ids(ragged_prompts(100), greedy)
    out["rope_greedy_no_cache"] = rope.generate_ids(ragged_prompts(100), greedy, use_cache=False)
    gqa = Generator(CodeGeeXModel(tiny_config(**GQA_WINDOW), ModelGroups.from_topology(topology), seed=11), None)
    out["cache_gqa_window"] = cache_vs_full(gqa.model)
    out["gqa_cache_shapes"] = [tuple(k.shape) for k in gqa.model.new_kv_cache(2, 5).keys]
    out["gqa_greedy"] = gqa.generate_ids(ragged_prompts(100), greedy)
    out["gqa_greedy_no_cache"] = gqa.generate_ids(ragged_prompts(100), greedy, use_cache=False)
    gen = Generator.from_checkpoint(ckpt_dir, None, tp_group=topology.tp_group)
    out["greedy"] = gen.generate_ids(prompts, SamplingParams(max_new_tokens=NEW_TOKENS))
    out["sampled"] = gen.generate_ids(prompts, SAMPLING)
    out["sampled_again"] = gen.generate_ids(prompts, SAMPLING)
    # continuous batching at TP 2: 3 samples a prompt through 2 slots, and all at once
    out["sampled_slots"] = gen.generate_ids(prompts, SAMPLING, num_samples=3, batch_size=2, end_ids=(7, 9, 11))
    out["sampled_all"] = gen.generate_ids(prompts, SAMPLING, num_samples=3, end_ids=(7, 9, 11))
    return out
