"""The run's layout, derived once from the flags (``config.arguments.validate``) and passed everywhere after: the
ranks (``ParallelDims``), the global batch over DP ranks and micro-batches, the layers over pipeline stages."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from codegeex_train.distributed.topology import ParallelDims


@dataclass(frozen=True)
class Layout:
    """How a global batch maps onto ranks and micro-batches, and layers onto stages."""

    dims: ParallelDims
    micro_batch_size: int
    num_microbatches: int
    stage_layers: tuple[Sequence[int], ...] = field(default=())  # global layer numbers of each pipeline stage
    # Interleaved 1F1B (--num-layers-per-virtual-pipeline-stage): v model chunks per rank, chunk_layers[r][c] the
    # layers of rank r's chunk c (virtual stage c·p + r); stage_layers[r] is then their union, in order.
    num_chunks: int = 1
    chunk_layers: tuple[tuple[range, ...], ...] = field(default=())

    def rank_chunks(self, pp_rank: int) -> tuple[Sequence[int], ...]:
        """The layers of each model chunk of ``pp_rank`` (one chunk, the stage's layers, without interleaving)."""
        return self.chunk_layers[pp_rank] if self.chunk_layers else (self.stage_layers[pp_rank],)

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.num_microbatches * self.dims.dp_size
