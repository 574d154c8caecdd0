"""What a training run recomputes in backward instead of keeping: Megatron's --recompute-* flags as one value.

full       whole layers: each unit keeps only its input and is re-run in backward (about a third more compute).
           ``uniform``: the stage's layers in consecutive units of ``num_layers``; ``block``: the first
           ``num_layers`` layers of the stage one by one, the rest kept. ``--checkpoint-activations`` is full,
           uniform, 1.
selective  only cheap, memory-heavy parts (Korthikanti et al. 2022): ``core_attn`` (QK^T, softmax, dropout, x V;
           the s x s terms on the math path), and as choices ``mlp_act`` (the MLP activation's output, the 4h-wide
           input of the second MLP linear) and ``layernorm`` (the LayerNorm outputs, the inputs of the
           column-parallel linears).
The top query layer counts as the stage's last layer: a unit of its own under uniform, the layer after the
regular ones under block.
"""

from __future__ import annotations

from dataclasses import dataclass

GRANULARITIES = ("full", "selective")
METHODS = ("uniform", "block")
MODULES = ("core_attn", "mlp_act", "layernorm")


@dataclass(frozen=True)
class Recompute:
    granularity: str | None = None  # None: keep every activation
    method: str = "uniform"
    num_layers: int = 1
    modules: tuple[str, ...] = ("core_attn",)

    @classmethod
    def full(cls) -> "Recompute":
        return cls("full")

    def __post_init__(self) -> None:
        if self.granularity not in (None, *GRANULARITIES):
            raise ValueError(f"--recompute-granularity {self.granularity!r}: choose full or selective")
        if self.method not in METHODS:
            raise ValueError(f"--recompute-method {self.method!r}: choose uniform or block")
        if self.num_layers < 1:
            raise ValueError(f"--recompute-num-layers {self.num_layers}: must be >= 1")
        unknown = set(self.modules) - set(MODULES)
        if unknown:
            raise ValueError(f"--recompute-modules {' '.join(sorted(unknown))}: choose from {', '.join(MODULES)}")

    @property
    def is_full(self) -> bool:
        return self.granularity == "full"

    def selects(self, module: str) -> bool:
        """Whether selective recompute covers ``module`` (one of MODULES)."""
        return self.granularity == "selective" and module in self.modules

    def full_units(self, num_layers: int) -> list[range]:
        """Indices (0-based, in the stage) of the regular layers each full-recompute unit covers; layers in no unit
        keep their activations."""
        if not self.is_full:
            return []
        if self.method == "block":
            return [range(i, i + 1) for i in range(min(self.num_layers, num_layers))]
        return [range(i, min(i + self.num_layers, num_layers)) for i in range(0, num_layers, self.num_layers)]

    def covers_top_query_layer(self, num_layers: int) -> bool:
        """Whether full recompute re-runs the top query layer of a last stage holding ``num_layers`` regular ones."""
        return self.is_full and (self.method == "uniform" or self.num_layers > num_layers)

    def describe(self) -> str:
        if self.granularity is None:
            return "none"
        if self.is_full:
            return f"full ({self.method}, {self.num_layers} layer{'s' if self.num_layers > 1 else ''})"
        return f"selective ({', '.join(self.modules)})"
