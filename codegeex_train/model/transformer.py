"""Pre-LayerNorm transformer layers: the regular GPT layer and CodeGeeX's top query layer.

Residual-stream tensors are replicated on every TP rank (they come out of an all-reduce), so the
hidden dropout on them uses the default RNG stream, seeded identically across the TP group: every
rank drops the same elements and the copies stay equal.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from codegeex_train.config.model import ModelConfig
from codegeex_train.model.attention import KVCacheSlot, ParallelSelfAttention, TopQueryAttention
from codegeex_train.model.init import ParamInit
from codegeex_train.model.mlp import ParallelMLP
from codegeex_train.tensor_parallel import RNGStatesTracker
from codegeex_train.tensor_parallel.mappings import ProcessGroup


def layer_norm(config: ModelConfig, dtype: torch.dtype, device) -> nn.LayerNorm:
    return nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon, dtype=dtype, device=device)  # w 1, b 0


class ParallelTransformerLayer(nn.Module):
    """x + drop(attn(LN(x))) then y + drop(mlp(LN(y)))."""

    attention_class = ParallelSelfAttention

    def __init__(self, config: ModelConfig, tp_group: ProcessGroup | None, rng_tracker: RNGStatesTracker | None,
                 init: ParamInit, prefix: str, *, dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.hidden_dropout = config.hidden_dropout
        self.input_layernorm = layer_norm(config, dtype, device)
        self.attention = self.attention_class(config, tp_group, rng_tracker, init, prefix + "attention.",
                                              dtype=dtype, device=device)
        self.post_attention_layernorm = layer_norm(config, dtype, device)
        self.mlp = ParallelMLP(config, tp_group, init, prefix + "mlp.", dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, *attention_args: torch.Tensor, cache: KVCacheSlot | None = None) -> torch.Tensor:
        """``cache``: this layer's slot of a KVCache when decoding incrementally (see attention.py)."""
        attn = self.attention(self.input_layernorm(x), *attention_args, cache=cache)  # (b, s, h)
        y = x + F.dropout(attn, self.hidden_dropout, self.training)
        return y + F.dropout(self.mlp(self.post_attention_layernorm(y)), self.hidden_dropout, self.training)


class TopQueryLayer(ParallelTransformerLayer):
    """CodeGeeX's last layer: the same residual structure, but attention queries come from the position
    (``forward(h, query_embeds)``). Input h is the final-LayerNorm'd output of the regular stack:
    y = h + drop(attn(LN_in(h), query_embeds)); out = y + drop(mlp(LN_post(y))). The output feeds the
    logits directly, with no further LayerNorm."""

    attention_class = TopQueryAttention
