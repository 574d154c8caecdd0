"""The run's parallel plan: one frozen value, made once by ``config.arguments.validate`` and passed to every consumer
(the model builder, the training loop, point-to-point, the DeepSpeed config, resume, the accounting), so that no one
recomputes a size from two flags.

    dims                tp, cp, pp, dp (``distributed.topology.ParallelDims``: the rank order and every group)
    micro-batches       micro_batch_size b, num_microbatches m per step per DP rank; global batch b x m x DP
    stages              stage_layers (each pipeline stage's layers); interleaved 1F1B: num_chunks v model chunks per
                        rank, chunk_layers[r][c] the layers of rank r's chunk c (virtual stage c·p + r)
    sequence parallel   --sequence-parallel as given; ``sp``: in effect (it needs TP > 1)
    recompute           the --recompute-* choice (config/recompute.py)
    activations         seq_length s, hidden_size h, dtype (bf16 | fp16 | fp32): what moves between stages,
                        ``p2p_shape`` (b, s/cp/tp under SP else s/cp, h) in ``p2p_dtype``
    context parallel    dims.cp_size: each CP rank holds ``local_seq_length`` = s/cp tokens of every sequence (two
                        of 2·cp chunks, context_parallel/chunks.py); DeepSpeed reduces over DP x CP

It lives in ``config`` because it holds config's values (``Recompute``); the layers below it take its parts: the
topology its ``dims``, point-to-point its activation shape and dtype (``P2PCommunicator.for_plan``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass, field

import torch

from codegeex_train.config.recompute import Recompute
from codegeex_train.distributed.topology import ParallelDims

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class ParallelPlan:
    """How the run maps onto ranks: dimensions, micro-batches, stages, and what moves between them."""

    dims: ParallelDims
    micro_batch_size: int
    num_microbatches: int
    stage_layers: tuple[Sequence[int], ...] = field(default=())  # global layer numbers of each pipeline stage
    num_chunks: int = 1
    chunk_layers: tuple[tuple[range, ...], ...] = field(default=())  # v > 1: rank -> its chunks' layers
    _: KW_ONLY
    sequence_parallel: bool = False
    recompute: Recompute = Recompute()
    seq_length: int = 0  # 0: no activation shape (a plan for the rank layout and batch arithmetic only)
    hidden_size: int = 0
    dtype: str = "fp32"  # of the activations and weights: bf16, fp16 or fp32

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r}: choose one of {', '.join(DTYPES)}")

    tp_size = property(lambda self: self.dims.tp_size)
    cp_size = property(lambda self: self.dims.cp_size)
    pp_size = property(lambda self: self.dims.pp_size)
    dp_size = property(lambda self: self.dims.dp_size)
    world_size = property(lambda self: self.dims.world_size)

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.num_microbatches * self.dims.dp_size

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_length

    @property
    def sp(self) -> bool:
        """Sequence parallelism in effect: it splits over a TP group of more than one rank."""
        return self.sequence_parallel and self.dims.tp_size > 1

    def rank_chunks(self, pp_rank: int) -> tuple[Sequence[int], ...]:
        """The layers of each model chunk of ``pp_rank`` (one chunk, the stage's layers, without interleaving)."""
        return self.chunk_layers[pp_rank] if self.chunk_layers else (self.stage_layers[pp_rank],)

    @property
    def local_seq_length(self) -> int:
        """The tokens of each sequence this rank's layers see: s, or s/cp under context parallelism."""
        return self.seq_length // self.dims.cp_size

    @property
    def p2p_shape(self) -> tuple[int, int, int]:
        """(b, s, h) of an activation sent between pipeline stages; a CP rank sends its s/cp tokens, and under SP each
        TP rank its (b, s/cp/tp, h)."""
        if not (self.seq_length and self.hidden_size):
            raise ValueError("this plan has no activation shape (seq_length, hidden_size)")
        seq = self.local_seq_length // self.dims.tp_size if self.sp else self.local_seq_length
        return self.micro_batch_size, seq, self.hidden_size

    @property
    def p2p_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element of the compute dtype (the theory's e)."""
        return DTYPES[self.dtype].itemsize
