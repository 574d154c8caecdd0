"""Initialisation that depends on neither TP nor PP: every parameter seeds its own generator.

A parameter's master weight is drawn from ``torch.Generator`` seeded by (seed, the parameter's global
name), so the numbers do not depend on which stage builds it, in which order, or how it is then split
across TP ranks. A pipeline stage that holds layers 8..15 therefore gets exactly the weights a single
process would, and the tied word embedding copy on the last stage equals the first stage's.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch

from codegeex_train.tensor_parallel import init_normal
from codegeex_train.tensor_parallel.layers import InitMethod


def param_generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator for parameter ``name``; crc32 keeps it stable across Python processes. The CPU generator
    (mt19937) keeps only the low 32 bits of its seed, so seed and name are hashed together into 32 bits (putting
    the seed in the high bits, as before, made every --seed give the same weights)."""
    mixed = zlib.crc32(name.encode(), zlib.crc32((seed & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little")))
    return torch.Generator().manual_seed(mixed)


@dataclass(frozen=True)
class ParamInit:
    """Init methods by parameter name: N(0, std), and N(0, std / sqrt(2 L)) for the projections that
    write into the residual stream (GPT-2 / Megatron's scaled init; L = number of regular layers)."""

    seed: int
    std: float
    num_layers: int

    def normal(self, name: str) -> InitMethod:
        return init_normal(self.std, param_generator(self.seed, name))

    def scaled(self, name: str) -> InitMethod:
        return init_normal(self.std / math.sqrt(2.0 * self.num_layers), param_generator(self.seed, name))

    def replicated(self, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                   device: torch.device | str | None) -> torch.nn.Parameter:
        """A parameter every TP rank holds whole (position / query embeddings): same numbers everywhere."""
        master = torch.empty(shape, dtype=torch.float32)
        self.normal(name)(master)
        return torch.nn.Parameter(master.to(device=device, dtype=dtype))
