"""The transformer MLP, split Megatron-style: column-parallel h -> ffn, row-parallel ffn -> h; under --swiglu the
column-parallel linear gives [gate; up] (h -> 2 ffn) and the activation is silu(gate) * up."""

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


class _SwiGLU(torch.autograd.Function):
    """[gate; up] along the last dim -> silu(gate) * up, keeping its input only: autograd's backward of silu and the
    product would keep gate, up and silu(gate) (a third ffn-wide tensor). Backward recomputes the sigmoid, as
    Megatron's fused bias-SwiGLU does."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        gate, up = x.chunk(2, dim=-1)
        s = torch.sigmoid(gate)
        # d/dg [g s(g)] = s (1 + g (1 - s))
        grad_gate = torch.sub(1.0, s).mul_(gate).add_(1.0).mul_(s).mul_(up).mul_(grad)
        grad_up = s.mul_(gate).mul_(grad)  # silu(gate) * grad
        return torch.cat([grad_gate, grad_up], dim=-1)


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """(..., 2 f) [gate; up] -> (..., f) silu(gate) * up (forward bit-identical to that formula)."""
    return _SwiGLU.apply(x)


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
    input (kept for the activation's own backward) when backward needs it.

    --swiglu: the first linear is h -> 2 ffn/tp, rank r holding [gate_r; up_r] (stride 2: the full weight is
    [gate; up], each block split over TP alike), and the activation is ``swiglu``. Biases iff config.linear_bias."""

    def __init__(self, config: ModelConfig, groups: ModelGroups, plan: ParallelPlan, init: ParamInit, prefix: str, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        super().__init__()
        h, ffn, bias = config.hidden_size, config.ffn_hidden_size, config.linear_bias
        self.dense_h_to_4h = ColumnParallelLinear(h, config.mlp_in_size, groups.tp, bias=bias, dtype=dtype,
                                                  device=device, sequence_parallel=plan.sp,
                                                  stride=2 if config.swiglu else 1,
                                                  init_method=init.normal(prefix + "dense_h_to_4h.weight"))
        self.dense_4h_to_h = RowParallelLinear(ffn, h, groups.tp, bias=bias, input_is_parallel=True,
                                               init_method=init.scaled(prefix + "dense_4h_to_h.weight"),
                                               sequence_parallel=plan.sp, dtype=dtype, device=device)
        self.activation = swiglu if config.swiglu else activation_fn(config.activation)
        self.recompute_activation = plan.recompute.selects("mlp_act")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = self.dense_h_to_4h(x)  # (b, s, ffn/tp); swiglu: (b, s, 2 ffn/tp), [gate_r; up_r]
        inner = self.activation(pre)
        if self.recompute_activation and torch.is_grad_enabled():
            with recompute_in_backward(inner, self.activation, pre):
                return self.dense_4h_to_h(inner)
        return self.dense_4h_to_h(inner)  # (b, s, h) all-reduced, or (b, s/tp, h) reduce-scattered
