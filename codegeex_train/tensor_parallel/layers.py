"""Tensor-parallel layers: ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding.

Each layer receives the TP process group it communicates over. Weights are initialised by building
the full (master) weight from the caller's ``init_method`` and keeping this rank's slice, so the
gathered model is the same at every TP size for the same seed.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from codegeex_train.tensor_parallel.mappings import (
    ProcessGroup,
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    group_rank,
    group_size,
    reduce_from_tensor_model_parallel_region,
    scatter_to_tensor_model_parallel_region,
)

InitMethod = Callable[[torch.Tensor], None]


def init_normal(std: float, generator: torch.Generator | None = None) -> InitMethod:
    """N(0, std) on a (CPU) master weight; pass a seeded generator to make init independent of PP."""

    def init_(weight: torch.Tensor) -> None:
        with torch.no_grad():
            weight.normal_(0.0, std, generator=generator)

    return init_


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(
            f"{what} {numerator} is not divisible by --tensor-model-parallel-size {denominator}: "
            f"choose sizes so that {what} is a multiple of the TP size"
        )
    return numerator // denominator


def set_tensor_model_parallel_attributes(param: nn.Parameter, partition_dim: int, stride: int = 1) -> None:
    """Tag a sharded parameter: DeepSpeed's grad norm counts it on every TP rank, and checkpoint tools
    know which dimension to concatenate (``stride`` > 1: the dimension holds ``stride`` blocks, e.g.
    Q, K and V, each split separately)."""
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = stride


def shard_master_weight(master: torch.Tensor, dim: int, rank: int, size: int, stride: int = 1) -> torch.Tensor:
    """This rank's slice of ``master`` along ``dim``; with ``stride`` blocks, the rank's part of each."""
    blocks = master.chunk(stride, dim=dim)
    return torch.cat([b.chunk(size, dim=dim)[rank] for b in blocks], dim=dim).contiguous()


def _sharded_parameter(
    shape: tuple[int, int], dim: int, group: ProcessGroup | None, init_method: InitMethod, stride: int,
    dtype: torch.dtype, device: torch.device | str | None,
) -> nn.Parameter:
    master = torch.empty(shape, dtype=torch.float32)  # on CPU: same numbers on every device and TP size
    init_method(master)
    shard = shard_master_weight(master, dim, group_rank(group), group_size(group), stride)
    param = nn.Parameter(shard.to(device=device, dtype=dtype))
    set_tensor_model_parallel_attributes(param, dim, stride)
    return param


class ColumnParallelLinear(nn.Module):
    """Y = X A + b with A split by columns: rank i computes Y_i = X A_i + b_i.

    Input is replicated (f: backward all-reduce of dX); output is Y_i, or the all-gathered Y when
    ``gather_output``. With ``skip_bias_add`` the bias is returned instead of added, for fusion.
    """

    def __init__(self, input_size: int, output_size: int, tp_group: ProcessGroup | None, *, bias: bool = True,
                 gather_output: bool = False, init_method: InitMethod = init_normal(0.02),
                 skip_bias_add: bool = False, stride: int = 1, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None):
        super().__init__()
        self.tp_group = tp_group
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        self.output_size_per_partition = divide(output_size, group_size(tp_group), "output size")
        # Weight is (out, in) as in nn.Linear; columns of A are rows here.
        self.weight = _sharded_parameter((output_size, input_size), 0, tp_group, init_method, stride, dtype, device)
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.output_size_per_partition, dtype=dtype, device=device))
            set_tensor_model_parallel_attributes(self.bias, 0, stride)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor):
        x = copy_to_tensor_model_parallel_region(x, self.tp_group)  # (b, s, h)
        bias = None if self.skip_bias_add else self.bias
        y = F.linear(x, self.weight, bias)  # (b, s, out/tp)
        if self.gather_output:
            y = gather_from_tensor_model_parallel_region(y, self.tp_group)  # (b, s, out)
        return (y, self.bias) if self.skip_bias_add else y


class RowParallelLinear(nn.Module):
    """Y = X A + b with A split by rows and X by columns: Y = sum_i X_i A_i (g: forward all-reduce).

    ``input_is_parallel``: X arrives already split (from a ColumnParallelLinear), so no scatter.
    The bias is replicated and added once, after the all-reduce.
    """

    def __init__(self, input_size: int, output_size: int, tp_group: ProcessGroup | None, *, bias: bool = True,
                 input_is_parallel: bool = False, init_method: InitMethod = init_normal(0.02),
                 skip_bias_add: bool = False, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None):
        super().__init__()
        self.tp_group = tp_group
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        self.input_size_per_partition = divide(input_size, group_size(tp_group), "input size")
        self.weight = _sharded_parameter((output_size, input_size), 1, tp_group, init_method, 1, dtype, device)
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size, dtype=dtype, device=device))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor):
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, self.tp_group)  # (b, s, in/tp)
        y = reduce_from_tensor_model_parallel_region(F.linear(x, self.weight), self.tp_group)  # (b, s, out)
        if self.skip_bias_add:
            return y, self.bias
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocabulary split into contiguous ranges, one per TP rank.

    Each rank looks up the ids in its range, writes zeros for the others, and the all-reduce (g)
    assembles the full rows: b*s*h elements, the same as any row-parallel output.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_group: ProcessGroup | None, *,
                 init_method: InitMethod = init_normal(0.02), dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None):
        super().__init__()
        self.tp_group = tp_group
        tp_size = group_size(tp_group)
        if num_embeddings < tp_size:
            raise ValueError(
                f"vocabulary size {num_embeddings} is smaller than --tensor-model-parallel-size {tp_size}"
            )
        self.num_embeddings = num_embeddings
        per_partition = divide(num_embeddings, tp_size, "vocabulary size")
        self.vocab_start_index = group_rank(tp_group) * per_partition
        self.vocab_end_index = self.vocab_start_index + per_partition
        self.weight = _sharded_parameter((num_embeddings, embedding_dim), 0, tp_group, init_method, 1, dtype, device)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if group_size(self.tp_group) == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
        local_ids = (input_ids - self.vocab_start_index).masked_fill(outside, 0)
        partial = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)  # (b, s, h)
        return reduce_from_tensor_model_parallel_region(partial, self.tp_group)
