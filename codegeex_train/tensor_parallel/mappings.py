"""Communication in and out of a tensor-parallel region, as conjugate autograd pairs.

Megatron's f and g: ``copy_to_tensor_model_parallel_region`` is f (forward identity, backward
all-reduce), ``reduce_from_tensor_model_parallel_region`` is g (forward all-reduce, backward identity).
Scatter and gather split / concatenate the last dimension. Each is a no-op when the group has one rank.

Sequence parallelism (Korthikanti et al. 2022) splits the activations between the TP regions along the
sequence, dimension 1 of our (b, s, h) tensors. An all-reduce is a reduce-scatter plus an all-gather, so f and g
become: ``gather_from_sequence_parallel_region`` (forward all-gather, backward reduce-scatter: f's place) and
``reduce_scatter_to_sequence_parallel_region`` (forward reduce-scatter, backward all-gather: g's place);
``scatter_to_sequence_parallel_region`` keeps this rank's part of a replicated tensor (backward all-gather).
The collectives run on a sequence-first copy, (s, b, h), whose dimension-0 chunks are contiguous; at b = 1 that
copy is a free view.
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


def split_sequence(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    size = group_size(group)
    if x.shape[1] % size:
        raise ValueError(f"sequence length {x.shape[1]} is not divisible by the tensor-parallel size {size} "
                         f"(--sequence-parallel)")
    return x.chunk(size, dim=1)[group_rank(group)].contiguous()


def all_gather_sequence(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """(b, s/t, h) on each rank -> (b, s, h), rank order along the sequence."""
    local = x.transpose(0, 1).contiguous()  # (s/t, b, h)
    out = torch.empty((local.shape[0] * group_size(group),) + local.shape[1:], dtype=x.dtype, device=x.device)
    if hasattr(dist, "all_gather_single"):  # newer torch's name; the old one warns (looked up per call: counters)
        dist.all_gather_single(out, local, group=group)
    else:
        dist.all_gather_into_tensor(out, local, group=group)
    return out.transpose(0, 1)  # (b, s, h)


def reduce_scatter_sequence(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """(b, s, h) partial sums on each rank -> this rank's (b, s/t, h) of their sum."""
    size = group_size(group)
    if x.shape[1] % size:
        raise ValueError(f"sequence length {x.shape[1]} is not divisible by the tensor-parallel size {size} "
                         f"(--sequence-parallel)")
    full = x.transpose(0, 1).contiguous()  # (s, b, h)
    out = torch.empty((full.shape[0] // size,) + full.shape[1:], dtype=x.dtype, device=x.device)
    if hasattr(dist, "reduce_scatter_single"):
        dist.reduce_scatter_single(out, full, group=group)
    else:
        dist.reduce_scatter_tensor(out, full, group=group)
    return out.transpose(0, 1)  # (b, s/t, h)


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


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """Forward: all-gather the sequence. Backward: reduce-scatter it (the gradient of a column-parallel input is a
    partial sum on each rank), or, for a consumer whose gradient is replicated, keep this rank's part."""

    @staticmethod
    def forward(ctx, x, group, grad_is_partial):
        ctx.group, ctx.grad_is_partial = group, grad_is_partial
        return all_gather_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.grad_is_partial:
            return reduce_scatter_sequence(grad, ctx.group), None, None
        return split_sequence(grad, ctx.group), None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Forward: reduce-scatter along the sequence (row-parallel partial sums). Backward: all-gather."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_sequence(grad, ctx.group), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    """Forward: keep this rank's part of the sequence of a replicated tensor. Backward: all-gather."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_sequence(grad, ctx.group), None


def copy_to_tensor_model_parallel_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return x if group_size(group) == 1 else _CopyToTensorModelParallelRegion.apply(x, group)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return x if group_size(group) == 1 else _ReduceFromTensorModelParallelRegion.apply(x, group)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return x if group_size(group) == 1 else _ScatterToTensorModelParallelRegion.apply(x, group)


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return x if group_size(group) == 1 else _GatherFromTensorModelParallelRegion.apply(x, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group: ProcessGroup | None,
                                         grad_is_partial: bool = True) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    return _GatherFromSequenceParallelRegion.apply(x, group, grad_is_partial)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return x if group_size(group) == 1 else _ReduceScatterToSequenceParallelRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return x if group_size(group) == 1 else _ScatterToSequenceParallelRegion.apply(x, group)
