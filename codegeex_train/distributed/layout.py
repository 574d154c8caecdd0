"""The run's layout, derived once from the flags (``config.arguments.validate``) and passed everywhere after: the
ranks (``ParallelDims``), the global batch over DP ranks and micro-batches, the layers over pipeline stages."""

from __future__ import annotations

from dataclasses import dataclass, field

from codegeex_train.distributed.topology import ParallelDims


@dataclass(frozen=True)
class Layout:
    """How a global batch maps onto ranks and micro-batches, and layers onto stages."""

    dims: ParallelDims
    micro_batch_size: int
    num_microbatches: int
    stage_layers: tuple[range, ...] = field(default=())  # global layer numbers of each pipeline stage

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.num_microbatches * self.dims.dp_size
