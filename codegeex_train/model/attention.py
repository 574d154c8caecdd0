"""Causal self-attention split by heads, and the top query layer's attention (queries from positions).

Each TP rank owns heads/tp heads: the fused projection is column-parallel with ``stride`` blocks, so the
FULL weight keeps GPT-2's [Q; K; V] block layout while rank r holds [Q_r; K_r; V_r] (its heads' rows of
each block). The output projection is row-parallel: one all-reduce forward, and the f inside the
column-parallel input gives the one all-reduce backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..tensor_parallel import ColumnParallelLinear, RNGStatesTracker, RowParallelLinear, divide
from ..tensor_parallel.mappings import ProcessGroup, group_size
from .config import ModelConfig
from .init import ParamInit


def _split_heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    b, s, _ = x.shape
    return x.view(b, s, -1, head_dim).transpose(1, 2)  # (b, heads/tp, s, d)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int, dropout_p: float,
                     rng_tracker: RNGStatesTracker | None) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + causal) v on (b, s, heads/tp * d) inputs -> (b, s, heads/tp * d)."""
    q, k, v = (_split_heads(t, head_dim) for t in (q, k, v))  # (b, n/tp, s, d)
    if dropout_p > 0.0 and rng_tracker is not None:
        # The probabilities belong to this rank's heads only: draw the mask from the TP-rank stream,
        # or every rank would repeat the same mask on different heads.
        with rng_tracker.fork():
            ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)
    else:
        ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)
    b, _, s, _ = ctx.shape
    return ctx.transpose(1, 2).reshape(b, s, -1)  # (b, s, h/tp)


class ParallelSelfAttention(nn.Module):
    """GPT-2 attention: fused QKV column-parallel (stride 3), causal SDPA, row-parallel output."""

    def __init__(self, config: ModelConfig, tp_group: ProcessGroup | None, rng_tracker: RNGStatesTracker | None,
                 init: ParamInit, prefix: str, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None):
        super().__init__()
        h = config.hidden_size
        self.head_dim, self.dropout_p, self.rng_tracker = config.head_dim, config.attention_dropout, rng_tracker
        self.hidden_per_partition = divide(h, group_size(tp_group), "hidden size")
        self.query_key_value = ColumnParallelLinear(h, 3 * h, tp_group, stride=3, dtype=dtype, device=device,
                                                    init_method=init.normal(prefix + "query_key_value.weight"))
        self.dense = RowParallelLinear(h, h, tp_group, input_is_parallel=True, dtype=dtype, device=device,
                                       init_method=init.scaled(prefix + "dense.weight"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.query_key_value(x)  # (b, s, 3h/tp) = [q_r | k_r | v_r]
        q, k, v = qkv.split(self.hidden_per_partition, dim=-1)  # 3 x (b, s, h/tp)
        p = self.dropout_p if self.training else 0.0
        ctx = causal_attention(q, k, v, self.head_dim, p, self.rng_tracker)  # (b, s, h/tp)
        return self.dense(ctx)  # (b, s, h)


class TopQueryAttention(nn.Module):
    """CodeGeeX's top query attention: keys and values from the hidden states (fused KV, stride 2),
    queries from a separate embedding of the position (query i predicts token i + 1)."""

    def __init__(self, config: ModelConfig, tp_group: ProcessGroup | None, rng_tracker: RNGStatesTracker | None,
                 init: ParamInit, prefix: str, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None):
        super().__init__()
        h = config.hidden_size
        self.head_dim, self.dropout_p, self.rng_tracker = config.head_dim, config.attention_dropout, rng_tracker
        self.hidden_per_partition = divide(h, group_size(tp_group), "hidden size")
        self.query = ColumnParallelLinear(h, h, tp_group, dtype=dtype, device=device,
                                          init_method=init.normal(prefix + "query.weight"))
        self.key_value = ColumnParallelLinear(h, 2 * h, tp_group, stride=2, dtype=dtype, device=device,
                                              init_method=init.normal(prefix + "key_value.weight"))
        self.dense = RowParallelLinear(h, h, tp_group, input_is_parallel=True, dtype=dtype, device=device,
                                       init_method=init.scaled(prefix + "dense.weight"))

    def forward(self, x: torch.Tensor, query_embeds: torch.Tensor) -> torch.Tensor:
        q = self.query(query_embeds)  # (b, s, h/tp)
        k, v = self.key_value(x).split(self.hidden_per_partition, dim=-1)  # 2 x (b, s, h/tp)
        p = self.dropout_p if self.training else 0.0
        ctx = causal_attention(q, k, v, self.head_dim, p, self.rng_tracker)  # (b, s, h/tp)
        return self.dense(ctx)  # (b, s, h)
