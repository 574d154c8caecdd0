"""Cross-entropy over vocab-sharded logits, without gathering them.

Gathering logits would move b*s*v elements. Instead each rank reduces its shard to per-token numbers
and only those cross the wire: the row max (all-reduce MAX, b*s elements), then the sum of exp and the
target's logit together (one all-reduce SUM of 2*b*s elements). The target logit is nonzero on exactly
one rank (the one whose vocab range holds the target), so summing assembles it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .mappings import ProcessGroup, group_rank, group_size


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_shard, target, group, ignore_index):
        # logits_shard: (..., v/tp) fp32; target: (...) global vocab ids.
        logits = logits_shard.float()
        row_max = logits.max(dim=-1).values  # (...)
        if group_size(group) > 1:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        logits = logits - row_max.unsqueeze(-1)  # a new tensor: the caller's logits stay intact

        per_partition = logits.shape[-1]
        vocab_start = group_rank(group) * per_partition
        ignored = target == ignore_index
        outside = (target < vocab_start) | (target >= vocab_start + per_partition) | ignored
        local_target = (target - vocab_start).masked_fill(outside, 0)
        target_logit = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)

        exp_logits = logits.exp_()  # reuse the buffer: exp is all backward needs
        sum_exp = exp_logits.sum(dim=-1)
        if group_size(group) > 1:
            both = torch.stack([sum_exp, target_logit])  # one all-reduce of 2*b*s elements
            dist.all_reduce(both, group=group)
            sum_exp, target_logit = both[0], both[1]

        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)
        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside, ignored)
        ctx.input_dtype = logits_shard.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside, ignored = ctx.saved_tensors
        # d loss / d logit_j = softmax_j - 1[j == target], only this rank's columns.
        grad = softmax.clone()
        on_rank = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -on_rank.unsqueeze(-1))
        grad.mul_((grad_loss * (~ignored).to(grad.dtype)).unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None, None


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor, target: torch.Tensor, tp_group: ProcessGroup | None, ignore_index: int = -100
) -> torch.Tensor:
    """Per-token loss (same shape as ``target``) from this rank's vocab shard of the logits.

    Positions whose target is ``ignore_index`` get loss 0 and no gradient; weight the rest with a loss
    mask as usual (``(loss * mask).sum() / mask.sum()``).
    """
    return _VocabParallelCrossEntropy.apply(logits_shard, target, tp_group, ignore_index)
