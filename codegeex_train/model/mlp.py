"""The transformer MLP, split Megatron-style: column-parallel h -> ffn, row-parallel ffn -> h."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from codegeex_train.config.model_config import ModelConfig
from codegeex_train.layout.plan import ParallelPlan
from codegeex_train.model.groups import ModelGroups
from codegeex_train.model.init import ParamInit
from codegeex_train.tensor_parallel import ColumnParallelLinear, RowParallelLinear, recompute_in_backward


class _FastGeLU(torch.autograd.Function):
    """x * sigmoid(1.702 x) with a hand-written backward: autograd's backward of the three ops makes five passes
    and four fresh (b, s, ffn/tp) tensors and keeps x and the sigmoid. This one keeps x alone (the sigmoid is one
    cheap pass to recompute, as Megatron's fused bias-GeLU recomputes its tanh) and makes two tensors, the
    recomputed sigmoid and the gradient, updating the latter in place."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.mul(x, 1.702).sigmoid_()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        s = torch.mul(x, 1.702).sigmoid_()
        # d/dx [x s] = s + 1.702 x s (1 - s) = s (1 + 1.702 x (1 - s))
        return torch.sub(1.0, s).mul_(x).mul_(1.702).add_(1.0).mul_(s).mul_(grad)


def fast_gelu(x: torch.Tensor) -> torch.Tensor:
    """CodeGeeX's sigmoid approximation of GELU (forward bit-identical to its x * sigmoid(1.702 x))."""
    return _FastGeLU.apply(x)


def activation_fn(name: str):
    if name == "gelu":
        return F.gelu
    if name == "gelu_tanh":  # GPT-2's gelu_new
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "fast_gelu":
        return fast_gelu
    raise ValueError(f"unknown --activation {name!r}: choose gelu, gelu_tanh or fast_gelu")


class ParallelMLP(nn.Module):
    """h -> ffn/tp (no communication), activation, ffn/tp -> h (one all-reduce forward; the f in the
    first linear gives the one all-reduce backward). Sequence parallel: all-gather in, reduce-scatter out.
    Selective recompute of ``mlp_act``: the activation's output, the second linear's input, is rebuilt from its
    input (kept for the activation's own backward) when backward needs it."""

    def __init__(self, config: ModelConfig, groups: ModelGroups, plan: ParallelPlan, init: ParamInit, prefix: str, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        super().__init__()
        h, ffn = config.hidden_size, config.ffn_hidden_size
        self.dense_h_to_4h = ColumnParallelLinear(h, ffn, groups.tp, dtype=dtype, device=device,
                                                  sequence_parallel=plan.sp,
                                                  init_method=init.normal(prefix + "dense_h_to_4h.weight"))
        self.dense_4h_to_h = RowParallelLinear(ffn, h, groups.tp, input_is_parallel=True,
                                               init_method=init.scaled(prefix + "dense_4h_to_h.weight"),
                                               sequence_parallel=plan.sp, dtype=dtype, device=device)
        self.activation = activation_fn(config.activation)
        self.recompute_activation = plan.recompute.selects("mlp_act")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = self.dense_h_to_4h(x)  # (b, s, ffn/tp)
        inner = self.activation(pre)
        if self.recompute_activation and torch.is_grad_enabled():
            with recompute_in_backward(inner, self.activation, pre):
                return self.dense_4h_to_h(inner)
        return self.dense_4h_to_h(inner)  # (b, s, h) all-reduced, or (b, s/tp, h) reduce-scattered
