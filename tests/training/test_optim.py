"""build_optimizer: AdamW's fused kernel, equal up to rounding to PyTorch's reference single-tensor path."""

import torch
from torch import nn

from codegeex_train.config.arguments import OptimConfig
from codegeex_train.training.optim import build_optimizer


def train_steps(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int = 6) -> list[torch.Tensor]:
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def test_fused_adamw_equals_the_reference_path():
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1, adam_beta2=0.95, adam_eps=1e-8)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))
    reference = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))
    reference.load_state_dict(model.state_dict())
    reference_start = [p.detach().clone() for p in reference.parameters()]
    ours = build_optimizer(model, cfg)
    assert all(group["fused"] for group in ours.param_groups)
    assert [g["weight_decay"] for g in ours.param_groups] == [0.1, 0.0]  # matrices decay, biases do not
    plain = torch.optim.AdamW([{"params": [p for p in reference.parameters() if p.ndim >= 2], "weight_decay": 0.1},
                               {"params": [p for p in reference.parameters() if p.ndim < 2], "weight_decay": 0.0}],
                              lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, foreach=False)
    got, want = train_steps(model, ours), train_steps(reference, plain)
    start = reference_start
    for a, b, s0 in zip(got, want, start):
        assert (a - b).abs().max() <= 1e-6  # a few float32 ulps after 6 steps (the kernels round differently)
        assert (b - s0).abs().max() > 1e-3  # while each weight moved a thousand times more
