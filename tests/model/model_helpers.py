"""Shared pieces of the model tests: a tiny config, batches, gathering shards, a dense reference."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from codegeex_train.checkpoint import merge_state_dicts
from codegeex_train.layout.dims import ParallelDims
from codegeex_train.layout.plan import ParallelPlan
from codegeex_train.model import ModelConfig
from codegeex_train.tensor_parallel import selective_recompute as recompute_module

B, S = 2, 16


def tiny_config(**overrides) -> ModelConfig:
    fields = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=100, max_position_embeddings=16,
                  make_vocab_size_divisible_by=128, hidden_dropout=0.0, attention_dropout=0.0,
                  activation="fast_gelu", top_query_layer=True,
                  init_method_std=0.2)  # large enough that attention is far from uniform
    fields.update(overrides)
    return ModelConfig(**fields)


def model_plan(layout=None, **options) -> ParallelPlan:
    """The plan a test's model is built with: the ranks' layout (a Topology's dims, or ParallelDims; one rank
    without) and the model's options (sequence_parallel, recompute); one micro-batch (the model reads no batch
    size)."""
    dims = ParallelDims(1) if layout is None else layout if isinstance(layout, ParallelDims) else layout.dims
    return ParallelPlan.derive(dims, micro_batch_size=1, **options)


class SavedBytes:
    """``with SavedBytes(model) as saved: <forward>``; ``saved.bytes``: the distinct storages autograd keeps for
    backward, parameters excluded. Saved-tensor hooks do not nest: inside a selective-recompute block only the block's
    own hooks run, and they report every tensor they keep (not their target) to ``recompute.OBSERVERS``."""

    def __init__(self, model):
        self.exclude = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seen, self.bytes = set(), 0

    def pack(self, t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.exclude | self.seen:
            self.seen.add(storage.data_ptr())
            self.bytes += storage.nbytes()
        return t

    def __enter__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self.hooks.__enter__()
        recompute_module.OBSERVERS.append(self.pack)
        return self

    def __exit__(self, *exc):
        recompute_module.OBSERVERS.remove(self.pack)
        self.hooks.__exit__(*exc)


def make_batch(config: ModelConfig, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (B, S), generator=g)
    labels = torch.randint(0, config.vocab_size, (B, S), generator=g)
    position_ids = torch.arange(S).expand(B, S)
    weights = torch.rand(B, S, generator=g)  # a non-uniform loss weighting exercises every token's grad
    return ids, position_ids, labels, weights


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def gather_full(tensors: dict[str, torch.Tensor], config: ModelConfig, group) -> dict[str, torch.Tensor]:
    """Per-rank shards (params or grads, by parameter name) -> the TP=1 tensors."""
    size = dist.get_world_size(group)
    per_rank: list[dict] = [{} for _ in range(size)]
    for name, t in tensors.items():
        parts = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(parts, t.contiguous(), group=group)
        for rank, part in enumerate(parts):
            per_rank[rank][name] = part
    return merge_state_dicts(per_rank, config)


# --- Dense reference: the model's maths in plain torch, written independently of the model's code ------

def _ln(x, w, b, eps):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * w + b


def _act(x, name):
    if name == "fast_gelu":
        return x * torch.sigmoid(1.702 * x)
    if name == "gelu_tanh":
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def _attend(q, k, v, heads):
    b, s, h = q.shape
    d = h // heads
    q, k, v = (t.reshape(b, s, heads, d).permute(0, 2, 1, 3) for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)  # (b, n, s, s)
    future = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)
    probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    return (probs @ v).permute(0, 2, 1, 3).reshape(b, s, h)


def _rope(t, position_ids, config):
    """RoPE as complex numbers: channel pair (a, b) of each head as a + ib, times e^(i position theta_j); pairs
    (j, j + r/2), or (2j, 2j + 1) interleaved; the channels past r pass through. Float64 angles."""
    if config.position_embedding_type != "rope":
        return t
    b, s, h = t.shape
    d, r = config.hidden_size // config.num_attention_heads, int(config.hidden_size // config.num_attention_heads
                                                                  * config.rotary_percent)
    t = t.reshape(b, s, -1, d)
    theta = float(config.rotary_base) ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)  # (r/2,)
    turn = torch.polar(torch.ones(b, s, 1, r // 2, dtype=torch.float64), position_ids[..., None, None] * theta)
    rot = t[..., :r]
    if config.rotary_interleaved:
        z = torch.complex(rot[..., 0::2], rot[..., 1::2]) * turn
        rot = torch.stack([z.real, z.imag], dim=-1).flatten(-2)
    else:
        z = torch.complex(rot[..., : r // 2], rot[..., r // 2:]) * turn
        rot = torch.cat([z.real, z.imag], dim=-1)
    return torch.cat([rot, t[..., r:]], dim=-1).reshape(b, s, h)


def _mlp(x, sd, p, act):
    inner = _act(x @ sd[p + "mlp.dense_h_to_4h.weight"].T + sd[p + "mlp.dense_h_to_4h.bias"], act)
    return inner @ sd[p + "mlp.dense_4h_to_h.weight"].T + sd[p + "mlp.dense_4h_to_h.bias"]


def dense_logits(sd: dict[str, torch.Tensor], config: ModelConfig, ids, position_ids) -> torch.Tensor:
    """Full logits (b, s, padded v) from a TP=1 state dict, dropout off, float64. Learned positions, or RoPE: no
    table, queries and keys of every attention turned by the position, the top query table's one row everywhere."""
    sd = {k: v.double() for k, v in sd.items()}
    eps, heads, h, act = config.layernorm_epsilon, config.num_attention_heads, config.hidden_size, config.activation
    rope = config.position_embedding_type == "rope"
    x = sd["word_embeddings.weight"][ids]
    if not rope:
        x = x + sd["position_embeddings.weight"][position_ids]
    for i in range(config.num_layers):
        p = f"layers.{i}."
        a = _ln(x, sd[p + "input_layernorm.weight"], sd[p + "input_layernorm.bias"], eps)
        qkv = a @ sd[p + "attention.query_key_value.weight"].T + sd[p + "attention.query_key_value.bias"]
        q, k = (_rope(t, position_ids, config) for t in (qkv[..., :h], qkv[..., h:2 * h]))
        ctx = _attend(q, k, qkv[..., 2 * h:], heads)
        x = x + ctx @ sd[p + "attention.dense.weight"].T + sd[p + "attention.dense.bias"]
        x = x + _mlp(_ln(x, sd[p + "post_attention_layernorm.weight"], sd[p + "post_attention_layernorm.bias"], eps),
                     sd, p, act)
    x = _ln(x, sd["final_layernorm.weight"], sd["final_layernorm.bias"], eps)
    if config.top_query_layer:
        p = "top_query_layer."
        a = _ln(x, sd[p + "input_layernorm.weight"], sd[p + "input_layernorm.bias"], eps)
        # query i: "which token comes at i + 1?"; under RoPE one row, turned by the position
        query = sd["top_query_embeddings.weight"][torch.zeros_like(position_ids) if rope else position_ids]
        q = query @ sd[p + "attention.query.weight"].T + sd[p + "attention.query.bias"]
        kv = a @ sd[p + "attention.key_value.weight"].T + sd[p + "attention.key_value.bias"]
        q, k = (_rope(t, position_ids, config) for t in (q, kv[..., :h]))
        ctx = _attend(q, k, kv[..., h:], heads)
        y = x + ctx @ sd[p + "attention.dense.weight"].T + sd[p + "attention.dense.bias"]
        x = y + _mlp(_ln(y, sd[p + "post_attention_layernorm.weight"], sd[p + "post_attention_layernorm.bias"], eps),
                     sd, p, act)
    return x @ sd["word_embeddings.weight"].T


def hf_batch(config: ModelConfig):
    """Token ids covering the whole (unpadded) vocabulary, for comparing against Hugging Face."""
    ids = torch.randperm(config.vocab_size, generator=torch.Generator().manual_seed(3))[: 4 * S].reshape(4, S)
    return ids, torch.arange(S).expand(4, S)
