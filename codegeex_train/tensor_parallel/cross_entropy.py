"""Cross-entropy over vocab-sharded logits, without gathering them.

Gathering logits would move b*s*v elements. Instead each rank reduces its shard to per-token numbers
and only those cross the wire: the row max (all-reduce MAX, b*s elements), then the sum of exp and the
target's logit together (one all-reduce SUM of 2*b*s elements). The target logit is nonzero on exactly
one rank (the one whose vocab range holds the target), so summing assembles it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from codegeex_train.tensor_parallel.mappings import ProcessGroup, group_rank, group_size


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_shard, target, group, ignore_index, inplace):
        # logits_shard: (..., v/tp); target: (...) global vocab ids. The (b, s, v/tp) buffer is the costly
        # part on CPU: every pass over it is memory-bound and every fresh one page-faults, so one buffer
        # (the caller's own with ``inplace``) becomes exp(logits - max) in place and backward turns it into
        # the gradient in place.
        logits = logits_shard.detach().float()
        if logits.data_ptr() == logits_shard.data_ptr() and not inplace:
            logits = logits.clone()  # the caller still needs its logits
        row_max = logits.amax(dim=-1)  # (...)
        if group_size(group) > 1:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        logits.sub_(row_max.unsqueeze(-1))

        per_partition = logits.shape[-1]
        vocab_start = group_rank(group) * per_partition
        ignored = target == ignore_index
        outside = (target < vocab_start) | (target >= vocab_start + per_partition) | ignored
        local_target = (target - vocab_start).masked_fill(outside, 0)
        target_logit = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)

        exp_logits = logits.exp_()
        sum_exp = exp_logits.sum(dim=-1)
        if group_size(group) > 1:
            both = torch.stack([sum_exp, target_logit])  # one all-reduce of 2*b*s elements
            dist.all_reduce(both, group=group)
            sum_exp, target_logit = both[0], both[1]

        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)
        ctx.save_for_backward(exp_logits, sum_exp, local_target, outside, ignored)
        ctx.input_dtype, ctx.used = logits_shard.dtype, False
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.used:
            raise RuntimeError("vocab_parallel_cross_entropy: backward through the same loss twice (retain_graph) "
                               "is not supported: its saved buffer becomes the gradient in place")
        ctx.used = True
        exp_logits, sum_exp, local_target, outside, ignored = ctx.saved_tensors
        # d loss / d logit_j = softmax_j - 1[j == target], only this rank's columns; softmax = exp / sum.
        scale = grad_loss.masked_fill(ignored, 0.0)  # (...)
        grad = exp_logits.mul_((scale / sum_exp).unsqueeze(-1))
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -scale.masked_fill(outside, 0.0).unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor, target: torch.Tensor, tp_group: ProcessGroup | None, ignore_index: int = -100, *,
    inplace: bool = False,
) -> torch.Tensor:
    """Per-token loss (same shape as ``target``) from this rank's vocab shard of the logits.

    Positions whose target is ``ignore_index`` get loss 0 and no gradient; weight the rest with a loss
    mask as usual (``(loss * mask).sum() / mask.sum()``). ``inplace``: the logits are the caller's scratch
    (as in Megatron) and are overwritten, saving a copy of b*s*v/tp elements; backward works either way.
    """
    return _VocabParallelCrossEntropy.apply(logits_shard, target, tp_group, ignore_index, inplace)
