"""Shared pieces of the executor tests: the activation shape, deterministic micro-batches, and a weakly
referenceable holder for what autograd saves (to see when it is freed)."""

import torch

SHAPE = (2, 3, 8)  # (micro-batch, sequence, hidden)


def microbatch(i):
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(100 + i))


class Saved:  # what autograd keeps for one saved tensor; weakly referenced to see when it is freed
    __slots__ = ("t", "__weakref__")

    def __init__(self, t):
        self.t = t
