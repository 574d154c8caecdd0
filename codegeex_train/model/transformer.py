"""Pre-norm transformer layers: the regular GPT layer and CodeGeeX's top query layer (norms.py: LayerNorm or
RMSNorm, --normalization).

Residual-stream tensors are replicated on every TP rank (they come out of an all-reduce), so the
hidden dropout on them uses the default RNG stream, seeded identically across the TP group: every
rank drops the same elements and the copies stay equal. Under sequence parallelism each rank holds its own part
of the sequence instead: the norms, residual adds and dropouts run on (b, s/tp, h), the dropout draws from
the per-TP-rank stream (different tokens, different masks), and the norms' parameters' gradients are completed
over TP (``sequence_parallel_parameter``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from codegeex_train.config.model_config import ModelConfig
from codegeex_train.layout.plan import ParallelPlan
from codegeex_train.model.attention import KVCacheSlot, ParallelSelfAttention, TopQueryAttention
from codegeex_train.model.groups import ModelGroups
from codegeex_train.model.init import ParamInit
from codegeex_train.model.mlp import ParallelMLP
from codegeex_train.model.norms import LayerNorm, RMSNorm, layer_norm
from codegeex_train.tensor_parallel import RNGStatesTracker, recompute_in_backward


def sequence_parallel_dropout(x: torch.Tensor, p: float, training: bool, rng_tracker: RNGStatesTracker | None,
                              sequence_parallel: bool) -> torch.Tensor:
    """Dropout on the residual stream: the default stream when it is replicated over TP, the per-TP-rank stream
    when each rank holds its own part of the sequence."""
    if sequence_parallel and training and p > 0.0 and rng_tracker is not None:
        with rng_tracker.fork():
            return F.dropout(x, p, training)
    return F.dropout(x, p, training)


class ParallelTransformerLayer(nn.Module):
    """x + drop(attn(LN(x))) then y + drop(mlp(LN(y))) (LN: the config's norm).

    Selective recompute of ``layernorm``: each norm's output (the next column-parallel linear's input) is
    rebuilt from its input when backward needs it."""

    attention_class = ParallelSelfAttention

    def __init__(self, config: ModelConfig, groups: ModelGroups, plan: ParallelPlan,
                 rng_tracker: RNGStatesTracker | None, init: ParamInit, prefix: str, *,
                 dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.hidden_dropout, self.rng_tracker = config.hidden_dropout, rng_tracker
        self.sequence_parallel = plan.sp
        self.recompute_layernorm = plan.recompute.selects("layernorm")
        self.input_layernorm = layer_norm(config, groups, plan, dtype, device)
        self.attention = self.attention_class(config, groups, plan, rng_tracker, init, prefix + "attention.",
                                              dtype=dtype, device=device)
        self.post_attention_layernorm = layer_norm(config, groups, plan, dtype, device)
        self.mlp = ParallelMLP(config, groups, plan, init, prefix + "mlp.", dtype=dtype, device=device)

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        return sequence_parallel_dropout(x, self.hidden_dropout, self.training, self.rng_tracker,
                                         self.sequence_parallel)

    def _normed(self, norm: LayerNorm | RMSNorm, x: torch.Tensor, consumer, *args, **kwargs) -> torch.Tensor:
        """consumer(norm(x), ...), keeping norm(x) only as a recipe under selective ``layernorm`` recompute."""
        normed = norm(x)
        if self.recompute_layernorm and torch.is_grad_enabled():
            with recompute_in_backward(normed, norm, x):
                return consumer(normed, *args, **kwargs)
        return consumer(normed, *args, **kwargs)

    def forward(self, x: torch.Tensor, *attention_args: torch.Tensor, rotary: torch.Tensor | None = None,
                cache: KVCacheSlot | None = None) -> torch.Tensor:
        """``attention_args``: the attention's inputs after its hidden states: the top query layer's query embeddings,
        then (any layer) the (b, 1, s, s) bool document mask of --reset-attention-mask when there is one. ``rotary``:
        the forward's RoPE tables (2, b, s, 1, r/2) under --position-embedding-type rope. Under full recompute both
        are ``checkpoint`` inputs (plain tensor arguments, saved by reference). ``cache``: this layer's slot of a
        KVCache when decoding incrementally (see attention.py)."""
        attn = self._normed(self.input_layernorm, x, self.attention, *attention_args, rotary=rotary,
                            cache=cache)  # (b, s, h)
        y = x + self._dropout(attn)
        return y + self._dropout(self._normed(self.post_attention_layernorm, y, self.mlp))


class TopQueryLayer(ParallelTransformerLayer):
    """CodeGeeX's last layer: the same residual structure, but attention queries come from the position
    (``forward(h, query_embeds)``; under RoPE from one learned row, rotated by the position). Input h is the
    final-LayerNorm'd output of the regular stack: y = h + drop(attn(LN_in(h), query_embeds));
    out = y + drop(mlp(LN_post(y))). The output feeds the logits directly, with no further LayerNorm."""

    attention_class = TopQueryAttention
