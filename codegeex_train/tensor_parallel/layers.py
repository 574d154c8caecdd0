"""Tensor-parallel layers: ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding.

Each layer receives the TP process group it communicates over. Weights are initialised by building
the full (master) weight from the caller's ``init_method`` and keeping this rank's slice, so the
gathered model is the same at every TP size for the same seed.

With ``sequence_parallel`` (Korthikanti et al. 2022) the activations outside the TP regions are split along the
sequence: a column-parallel layer all-gathers its input (backward: reduce-scatter) in place of f, a row-parallel
one reduce-scatters its output (backward: all-gather) in place of g, and the embedding reduce-scatters. The
column-parallel input is kept as it arrives, 1/t of the sequence, and all-gathered again in backward for the weight
gradient, as Megatron does: the memory of SP, at the price of one more all-gather per such layer.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from codegeex_train.tensor_parallel.mappings import (
    ProcessGroup,
    all_gather_sequence,
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    group_rank,
    group_size,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_sequence,
    reduce_scatter_to_sequence_parallel_region,
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


def set_tensor_model_parallel_attributes(param: nn.Parameter, partition_dim: int,
                                         stride: int | tuple[int, ...] = 1) -> None:
    """Tag a sharded parameter: DeepSpeed's grad norm counts it on every TP rank, and checkpoint tools
    know which dimension to concatenate (``stride`` > 1: the dimension holds ``stride`` blocks, e.g.
    Q, K and V, each split separately)."""
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = stride


def allreduce_sequence_parallel_grad(grad: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """The one TP all-reduce of a sequence-parallel parameter's gradient (a seam: tests break it on purpose)."""
    grad = grad.contiguous()
    dist.all_reduce(grad, group=group)
    return grad


class _SequenceParallelParameter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, param, group):
        ctx.group = group
        return param.view_as(param)

    @staticmethod
    def backward(ctx, grad):
        return allreduce_sequence_parallel_grad(grad, ctx.group), None


def sequence_parallel_parameter(param: nn.Parameter, group: ProcessGroup | None) -> torch.Tensor:
    """A parameter every TP rank holds whole but applies to its own part of the sequence only (LayerNorms, the
    row-parallel biases and the learned position tables under sequence parallelism): its gradient on each rank is a
    partial sum. Used through this function (f on the parameter), the all-reduce over TP in backward completes it,
    once per backward, where autograd produces it. That is the only moment it exists whole: ZeRO-2 reduces each
    ``.grad`` over DP and frees it at the end of every micro-batch's backward, and its accumulated partitions do not
    line up across TP ranks. An all-reduce is linear, so the m per-micro-batch sums add up to the sum of the step's
    gradient, which Megatron all-reduces once per step (``finalize_model_grads``). After it the copies' gradients
    are equal, so the gradient norm counts them once, on TP rank 0, like every replicated parameter (no
    ``tensor_model_parallel`` tag); ``sequence_parallel = True`` says which they are."""
    return param if group_size(group) == 1 else _SequenceParallelParameter.apply(param, group)


def mark_sequence_parallel(*params: nn.Parameter | None) -> None:
    for p in params:
        if p is not None:
            p.sequence_parallel = True


class _SequenceParallelColumnLinear(torch.autograd.Function):
    """Y = all-gather(X) A^T + b over the sequence; keeps X (this rank's s/t) and all-gathers it again in backward;
    dX = reduce-scatter(dY A)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(all_gather_sequence(x, group), weight, bias)  # (b, s, out/tp)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_input = reduce_scatter_sequence(grad.matmul(weight), ctx.group)  # (b, s/tp, in)
        total = all_gather_sequence(x, ctx.group).reshape(-1, x.shape[-1])  # (b*s, in)
        grad2d = grad.reshape(-1, grad.shape[-1])
        grad_weight = grad2d.t().matmul(total)
        grad_bias = grad2d.sum(0) if ctx.has_bias else None
        return grad_input, grad_weight, grad_bias, None


def split_blocks(tensor: torch.Tensor, dim: int, stride: int | tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """``tensor``'s blocks along ``dim``: ``stride`` equal ones, or blocks in the proportions of a tuple (grouped-query
    attention's fused [Q; K; V]: (heads, groups, groups))."""
    if isinstance(stride, int):
        return tensor.chunk(stride, dim=dim)
    unit = tensor.shape[dim] // sum(stride)
    return tensor.split([unit * w for w in stride], dim=dim)


def shard_master_weight(master: torch.Tensor, dim: int, rank: int, size: int,
                        stride: int | tuple[int, ...] = 1) -> torch.Tensor:
    """This rank's slice of ``master`` along ``dim``; with ``stride`` blocks (``split_blocks``), the rank's part of
    each."""
    blocks = split_blocks(master, dim, stride)
    return torch.cat([b.chunk(size, dim=dim)[rank] for b in blocks], dim=dim).contiguous()


def _sharded_parameter(
    shape: tuple[int, int], dim: int, group: ProcessGroup | None, init_method: InitMethod,
    stride: int | tuple[int, ...],
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
                 skip_bias_add: bool = False, stride: int | tuple[int, ...] = 1, sequence_parallel: bool = False,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        super().__init__()
        self.tp_group = tp_group
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        self.sequence_parallel = sequence_parallel and group_size(tp_group) > 1
        if self.sequence_parallel and (gather_output or skip_bias_add):
            raise ValueError("sequence_parallel goes with neither gather_output nor skip_bias_add")
        self.output_size_per_partition = divide(output_size, group_size(tp_group), "output size")
        # Weight is (out, in) as in nn.Linear; columns of A are rows here.
        self.weight = _sharded_parameter((output_size, input_size), 0, tp_group, init_method, stride, dtype, device)
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.output_size_per_partition, dtype=dtype, device=device))
            set_tensor_model_parallel_attributes(self.bias, 0, stride)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor):
        if self.sequence_parallel:  # x: (b, s/tp, h)
            return _SequenceParallelColumnLinear.apply(x, self.weight, self.bias, self.tp_group)  # (b, s, out/tp)
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
                 skip_bias_add: bool = False, sequence_parallel: bool = False, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None):
        super().__init__()
        self.tp_group = tp_group
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        self.sequence_parallel = sequence_parallel and group_size(tp_group) > 1
        if self.sequence_parallel and (skip_bias_add or not input_is_parallel):
            raise ValueError("sequence_parallel needs input_is_parallel and no skip_bias_add")
        self.input_size_per_partition = divide(input_size, group_size(tp_group), "input size")
        self.weight = _sharded_parameter((output_size, input_size), 1, tp_group, init_method, 1, dtype, device)
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size, dtype=dtype, device=device))
            if self.sequence_parallel:
                mark_sequence_parallel(self.bias)  # added to this rank's s/tp rows only
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor):
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(F.linear(x, self.weight), self.tp_group)  # (b, s/tp, out)
            return y if self.bias is None else y + sequence_parallel_parameter(self.bias, self.tp_group)
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, self.tp_group)  # (b, s, in/tp)
        y = reduce_from_tensor_model_parallel_region(F.linear(x, self.weight), self.tp_group)  # (b, s, out)
        if self.skip_bias_add:
            return y, self.bias
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocabulary split into contiguous ranges, one per TP rank.

    Each rank looks up the ids in its range, writes zeros for the others, and the all-reduce (g)
    assembles the full rows: b*s*h elements, the same as any row-parallel output. With ``sequence_parallel``
    the reduce-scatter over the sequence assembles this rank's s/tp rows instead.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_group: ProcessGroup | None, *,
                 init_method: InitMethod = init_normal(0.02), sequence_parallel: bool = False,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        super().__init__()
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel and group_size(tp_group) > 1
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
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)  # (b, s/tp, h)
        return reduce_from_tensor_model_parallel_region(partial, self.tp_group)
