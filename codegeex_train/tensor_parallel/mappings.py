"""Communication in and out of a tensor-parallel region, as conjugate autograd pairs.

Megatron's f and g: ``copy_to_tensor_model_parallel_region`` is f (forward identity, backward
all-reduce), ``reduce_from_tensor_model_parallel_region`` is g (forward all-reduce, backward identity).
Scatter and gather split / concatenate the last dimension. Each is a no-op when the group has one rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

ProcessGroup = dist.ProcessGroup


def group_size(group: ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def _all_reduce(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _split_last_dim(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    size = group_size(group)
    if x.shape[-1] % size:
        raise ValueError(f"last dimension {x.shape[-1]} is not divisible by the tensor-parallel size {size}")
    return x.chunk(size, dim=-1)[group_rank(group)].contiguous()


def _gather_last_dim(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(group_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=-1)


class _CopyToTensorModelParallelRegion(torch.autograd.Function):
    """f: forward identity, backward all-reduce."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTensorModelParallelRegion(torch.autograd.Function):
    """g: forward all-reduce, backward identity.

    As in Megatron, the all-reduce runs in place: x itself is summed and returned, no copy first. Its producers
    here (a row-parallel matmul, the masked embedding lookup) save nothing that holds it, and autograd's version
    check would catch one that did. A leaf that requires grad, a view or a strided tensor is reduced in a copy."""

    @staticmethod
    def forward(ctx, x, group):
        if (x.is_leaf and x.requires_grad) or x._base is not None or not x.is_contiguous():
            x = x.clone(memory_format=torch.contiguous_format)
        else:
            ctx.mark_dirty(x)
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTensorModelParallelRegion(torch.autograd.Function):
    """Forward: keep this rank's chunk of the last dim. Backward: all-gather the last dim."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last_dim(grad, ctx.group), None


class _GatherFromTensorModelParallelRegion(torch.autograd.Function):
    """Forward: all-gather the last dim. Backward: keep this rank's chunk."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last_dim(grad, ctx.group), None


def copy_to_tensor_model_parallel_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return x if group_size(group) == 1 else _CopyToTensorModelParallelRegion.apply(x, group)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return x if group_size(group) == 1 else _ReduceFromTensorModelParallelRegion.apply(x, group)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return x if group_size(group) == 1 else _ScatterToTensorModelParallelRegion.apply(x, group)


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return x if group_size(group) == 1 else _GatherFromTensorModelParallelRegion.apply(x, group)
