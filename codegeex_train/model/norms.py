"""The norms of the residual stream (--normalization): LayerNorm (weight and bias) or RMSNorm (weight only).

Under sequence parallelism (``sp_group`` given) each rank normalises its own tokens (b, s/tp, h) and the norm's
parameters' gradients are partial sums, completed over TP (``sequence_parallel_parameter``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from codegeex_train.config.model_config import ModelConfig
from codegeex_train.layout.plan import ParallelPlan
from codegeex_train.model.groups import ModelGroups
from codegeex_train.tensor_parallel import mark_sequence_parallel
from codegeex_train.tensor_parallel import sequence_parallel_parameter as sp_param
from codegeex_train.tensor_parallel.mappings import ProcessGroup


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm (weight 1, bias 0); with ``sp_group`` (sequence parallelism in effect) it normalises this rank's
    tokens only and its parameters' gradients are completed over TP."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device, sp_group: ProcessGroup | None = None):
        super().__init__(config.hidden_size, eps=config.layernorm_epsilon, dtype=dtype, device=device)
        self.sp_group = sp_group
        if self.sp_group is not None:
            mark_sequence_parallel(self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sp_group is None:
            return super().forward(x)
        return F.layer_norm(x, self.normalized_shape, sp_param(self.weight, self.sp_group),
                            sp_param(self.bias, self.sp_group), self.eps)


def _stat_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)  # fp32 for half inputs (fp64 stays, for references)


class _RMSNormFunction(torch.autograd.Function):
    """y = weight * (x * rsqrt(mean(x^2) + eps)) with a hand-written backward that keeps x and the (b, s, 1) fp32
    rsqrt only, as LayerNorm keeps its input and statistics: autograd through the formula would also keep the
    normalised (b, s, h) tensor and, for bf16 inputs, an fp32 copy of x (three times LayerNorm's bytes)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        x32 = x.to(_stat_dtype(x))
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)  # (b, s, 1) fp32
        ctx.save_for_backward(x, weight, rstd)
        return weight * (x32 * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        normed = x.to(rstd.dtype) * rstd  # (b, s, h) fp32
        grad_weight = (grad.to(rstd.dtype) * normed.to(x.dtype)).flatten(0, -2).sum(0).to(weight.dtype)
        grad_normed = (grad * weight).to(rstd.dtype)
        # d/dx of x r with r = (mean x^2 + eps)^(-1/2): r (dn - n mean(dn n))
        grad_x = (grad_normed - normed * (grad_normed * normed).mean(-1, keepdim=True)).mul_(rstd)
        return grad_x.to(x.dtype), grad_weight, None


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight (weight 1 at init, no bias; Llama's, Qwen2's).

    The statistic and the normalisation run in fp32 and the result is cast back before the weight multiplies it:
    Hugging Face's LlamaRMSNorm in that order, so an imported model gives its numbers (bit for bit in fp32). Written
    out rather than ``F.rms_norm``, whose fused kernels need not round alike on every device."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device, sp_group: ProcessGroup | None = None):
        super().__init__()
        self.eps = config.layernorm_epsilon
        self.weight = nn.Parameter(torch.ones(config.hidden_size, dtype=dtype, device=device))
        self.sp_group = sp_group
        if self.sp_group is not None:
            mark_sequence_parallel(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight if self.sp_group is None else sp_param(self.weight, self.sp_group)
        return _RMSNormFunction.apply(x, weight, self.eps)


def layer_norm(config: ModelConfig, groups: ModelGroups, plan: ParallelPlan, dtype: torch.dtype,
               device) -> LayerNorm | RMSNorm:
    """A norm of the residual stream, the config's kind: over this rank's part of the sequence when the plan has
    SP."""
    norm = RMSNorm if config.normalization == "RMSNorm" else LayerNorm
    return norm(config, dtype, device, groups.sequence_parallel_group(plan))
