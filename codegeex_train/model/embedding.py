"""Input embeddings (vocab-parallel words + replicated learned positions; none under RoPE, model/rotary.py) and the
output layer: the word table itself (tied) or, under --untie-embeddings-and-output-weights, ``output_layer`` with its
own weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from codegeex_train.model.init import ParamInit
from codegeex_train.tensor_parallel import (
    ColumnParallelLinear,
    VocabParallelEmbedding,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    mark_sequence_parallel,
    sequence_parallel_parameter,
)
from codegeex_train.tensor_parallel.mappings import ProcessGroup, group_rank, group_size


class ReplicatedEmbedding(nn.Module):
    """A plain lookup table every TP rank holds whole (positions, CodeGeeX's top queries).

    ``sp_group`` (sequence parallelism in effect): look up this rank's part of the sequence only, (b, s/tp, h); the
    table's gradient is then a partial sum, completed over TP (``sequence_parallel_parameter``)."""

    def __init__(self, num: int, dim: int, init: ParamInit, name: str, *, dtype: torch.dtype = torch.float32,
                 device=None, sp_group: ProcessGroup | None = None):
        super().__init__()
        self.weight = init.replicated(name, (num, dim), dtype, device)
        self.sp_group = sp_group  # given when the plan has sequence parallelism in effect
        if self.sp_group is not None:
            mark_sequence_parallel(self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.sp_group is None:
            return F.embedding(ids, self.weight)  # (b, s, h)
        ids = ids.chunk(group_size(self.sp_group), dim=1)[group_rank(self.sp_group)]
        return F.embedding(ids, sequence_parallel_parameter(self.weight, self.sp_group))  # (b, s/tp, h)


def word_embeddings(padded_vocab: int, hidden: int, tp_group: ProcessGroup | None, init: ParamInit, *,
                    sequence_parallel: bool = False, tied: bool = True, dtype: torch.dtype = torch.float32,
                    device=None) -> VocabParallelEmbedding:
    """The word table, rows split by vocab range. ``tied`` (the output layer is this table): built under the same
    name (so with the same values) on the first stage and, as the output layer's copy, on the last; tagged
    ``shared_embedding`` so training all-reduces its grad over the embedding group (a no-op when one stage holds
    both). Untied: the first stage's input table only, untagged."""
    emb = VocabParallelEmbedding(padded_vocab, hidden, tp_group, init_method=init.normal("word_embeddings.weight"),
                                 sequence_parallel=sequence_parallel, dtype=dtype, device=device)
    if tied:
        emb.weight.shared_embedding = True
    return emb


def output_layer(padded_vocab: int, hidden: int, tp_group: ProcessGroup | None, init: ParamInit, *,
                 dtype: torch.dtype = torch.float32, device=None) -> ColumnParallelLinear:
    """The untied output layer (Megatron's ``output_layer``): a (v, h) weight with rows split by vocab range like the
    word table's, no bias; only its weight is used (``parallel_lm_logits``, the same path as the tied table)."""
    return ColumnParallelLinear(hidden, padded_vocab, tp_group, bias=False, dtype=dtype, device=device,
                                init_method=init.normal("output_layer.weight"))


def parallel_lm_logits(hidden: torch.Tensor, weight_shard: torch.Tensor, tp_group: ProcessGroup | None,
                       gather: bool = False, sequence_parallel: bool = False) -> torch.Tensor:
    """Logits against the output weight (the tied word table or output_layer's): (b, s, h) -> (b, s, v/tp), or
    (b, s, v) gathered.

    f (copy) on the input: backward all-reduces dH, since each rank's vocab slice contributes to it. With
    ``sequence_parallel`` the input is (b, s/tp, h): all-gathered (backward: reduce-scatter) and kept whole, as
    Megatron's output layer keeps it.
    """
    if sequence_parallel:
        hidden = gather_from_sequence_parallel_region(hidden, tp_group)
    else:
        hidden = copy_to_tensor_model_parallel_region(hidden, tp_group)
    logits = F.linear(hidden, weight_shard)  # (b, s, v/tp)
    return gather_from_tensor_model_parallel_region(logits, tp_group) if gather else logits
