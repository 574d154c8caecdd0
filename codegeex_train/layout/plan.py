"""The run's parallel plan: one frozen value, derived once (``ParallelPlan.derive``, called by
``config.arguments.validate``, the planner and the memory check) and passed to every consumer (the model builder, the
training loop, point-to-point, the DeepSpeed config, resume, the accounting), so that no one recomputes a size from two
flags.

    dims                tp, cp, pp, dp (``layout.dims.ParallelDims``: the rank order; distributed/topology.py builds every group)
    micro-batches       micro_batch_size b, num_microbatches m per step per DP rank; global batch b x m x DP
    stages              stage_layers (each pipeline stage's layers); interleaved 1F1B: num_chunks v model chunks per
                        rank, chunk_layers[r][c] the layers of rank r's chunk c (virtual stage c·p + r)
    sequence parallel   --sequence-parallel as given; ``sp``: in effect (it needs TP > 1)
    recompute           the --recompute-* choice (layout/recompute.py)
    activations         seq_length s, hidden_size h, dtype (bf16 | fp16 | fp32): what moves between stages,
                        ``p2p_shape`` (b, s/cp/tp under SP else s/cp, h) in ``p2p_dtype``
    context parallel    dims.cp_size: each CP rank holds ``local_seq_length`` = s/cp tokens of every sequence (two
                        of 2·cp chunks, context_parallel/chunks.py); DeepSpeed reduces over DP x CP

The layout's rules live here and in the modules ``derive`` calls, each written once: the sizes and the rank order
(dims.py, with the model-parallel rank that names checkpoint files), the layer split (stages.py), the micro-batches
per step, the CP and SP sequence splits and the attention heads per TP rank (this module). Each raises ``LayoutError``
naming the flag to change.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass, field

import torch

from codegeex_train.layout.dims import ParallelDims
from codegeex_train.layout.errors import LayoutError
from codegeex_train.layout.recompute import Recompute
from codegeex_train.layout.stages import (
    chunked_stage_layers,
    covers_each_layer_once,
    layers_per_virtual_stage,
    rank_chunk_layers,
    stage_layer_ranges,
    virtual_pipeline_size,
)

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
            raise LayoutError(f"dtype {self.dtype!r}: choose one of {', '.join(DTYPES)}")

    @classmethod
    def derive(cls, dims: ParallelDims, *, micro_batch_size: int, global_batch_size: int | None = None,
               num_microbatches: int | None = None, num_layers: int | None = None,
               stage_layers: Sequence[Sequence[int]] | None = None,
               decoder_first_pipeline_num_layers: int | None = None,
               decoder_last_pipeline_num_layers: int | None = None,
               num_layers_per_virtual_pipeline_stage: int | None = None, num_chunks: int = 1,
               num_attention_heads: int | None = None, num_query_groups: int | None = None,
               sequence_parallel: bool = False,
               recompute: Recompute = Recompute(), seq_length: int = 0, hidden_size: int = 0,
               dtype: str = "fp32") -> ParallelPlan:
        """The plan of a layout, every rule checked in a fixed order; raises ``LayoutError`` naming the flag.

        Batch: ``global_batch_size`` = micro x m x DP (default micro x ``num_microbatches`` (default 1) x DP; both
        given, they must agree). Layers (``num_layers``; None: a plan without stages, for the rank layout and batch
        arithmetic only): split evenly, by the ``--decoder-first/last-pipeline-num-layers`` flags, or as
        ``stage_layers`` give (the planner's split, an existing plan's); interleaved 1F1B by the flag
        ``--num-layers-per-virtual-pipeline-stage`` or by v = ``num_chunks``, which also needs m divisible by PP.
        ``num_attention_heads``: whole heads per TP rank (None: unchecked). Sequence: 2·cp equal chunks under CP,
        whole pieces per TP rank under SP."""
        m = _microbatches_per_step(dims, micro_batch_size, global_batch_size, num_microbatches)
        stages, chunks = (), ()
        if num_layers is not None:
            if num_chunks != 1:
                if num_layers_per_virtual_pipeline_stage is not None:
                    raise LayoutError("give the model chunks per rank once: --num-layers-per-virtual-pipeline-stage "
                                      "or num_chunks")
                num_layers_per_virtual_pipeline_stage = layers_per_virtual_stage(num_layers, dims.pp_size, num_chunks)
            stages, chunks = _split_layers(dims, m, micro_batch_size, num_layers, stage_layers,
                                           decoder_first_pipeline_num_layers, decoder_last_pipeline_num_layers,
                                           num_layers_per_virtual_pipeline_stage)
        elif stage_layers or num_chunks != 1 or num_layers_per_virtual_pipeline_stage is not None:
            raise LayoutError("a layer split needs --num-layers")
        if num_attention_heads is not None:
            heads_per_tp_rank(num_attention_heads, dims.tp_size)
            if num_query_groups is not None:  # grouped-query attention: whole key-value groups per TP rank
                kv_groups_per_tp_rank(num_attention_heads, num_query_groups, dims.tp_size)
        _check_sequence_split(dims, seq_length, sequence_parallel)
        return cls(dims, micro_batch_size, m, stages, len(chunks[0]) if chunks else 1, chunks,
                   sequence_parallel=sequence_parallel, recompute=recompute, seq_length=seq_length,
                   hidden_size=hidden_size, dtype=dtype)

    tp_size = property(lambda self: self.dims.tp_size)
    cp_size = property(lambda self: self.dims.cp_size)
    pp_size = property(lambda self: self.dims.pp_size)
    dp_size = property(lambda self: self.dims.dp_size)
    world_size = property(lambda self: self.dims.world_size)

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.num_microbatches * self.dims.dp_size

    @property
    def deepspeed_train_batch_size(self) -> int:
        """DeepSpeed's ``train_batch_size``: micro-batch x accumulation x the data-parallel group ZeRO is given, which is
        DP x CP (``dims.data_shards``: every CP rank holds a share of each sequence, counted once more)."""
        return self.micro_batch_size * self.num_microbatches * self.dims.data_shards

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


def _microbatches_per_step(dims: ParallelDims, micro_batch_size: int, global_batch_size: int | None,
                           num_microbatches: int | None) -> int:
    """m: each DP rank's micro-batches per optimizer step (global batch = micro x m x DP)."""
    if micro_batch_size < 1:
        raise LayoutError(f"--micro-batch-size {micro_batch_size}: must be >= 1")
    per_step = micro_batch_size * dims.dp_size
    global_batch = global_batch_size or per_step * (num_microbatches or 1)
    if global_batch % per_step:
        raise LayoutError(
            f"--global-batch-size {global_batch} is not divisible by --micro-batch-size {micro_batch_size} x "
            f"data-parallel size {dims.dp_size} = {per_step}: use a multiple of {per_step}")
    m = global_batch // per_step
    if num_microbatches is not None and num_microbatches != m:
        raise LayoutError(
            f"--num-microbatches {num_microbatches} disagrees with --global-batch-size {global_batch} / "
            f"(--micro-batch-size {micro_batch_size} x DP {dims.dp_size}) = {m}")
    return m


def _split_layers(dims: ParallelDims, m: int, micro_batch_size: int, num_layers: int,
                  given: Sequence[Sequence[int]] | None, first: int | None, last: int | None,
                  per_virtual_stage: int | None) -> tuple[tuple[Sequence[int], ...], tuple[tuple[range, ...], ...]]:
    """(each stage's layers, each rank's chunks' layers (empty without interleaving)), as stages.py splits them."""
    pp = dims.pp_size
    if given:
        if first is not None or last is not None or per_virtual_stage is not None:
            raise LayoutError("a given stage split takes no --decoder-first/last-pipeline-num-layers or "
                              "--num-layers-per-virtual-pipeline-stage")
        if len(given) != pp or not covers_each_layer_once(given, num_layers):
            raise LayoutError(f"the stage split {list(given)} does not hold each of --num-layers "
                              f"{num_layers} once over --pipeline-model-parallel-size {pp} stages")
        return tuple(given), ()
    stages = tuple(stage_layer_ranges(num_layers, pp, first, last))
    v = virtual_pipeline_size(num_layers, pp, per_virtual_stage, first, last)
    if v == 1:
        return stages, ()
    if m % pp:
        global_batch = micro_batch_size * m * dims.dp_size
        raise LayoutError(
            f"interleaved 1F1B (--num-layers-per-virtual-pipeline-stage) needs the micro-batches per step "
            f"({m} = --global-batch-size {global_batch} / (--micro-batch-size {micro_batch_size} x DP "
            f"{dims.dp_size})) divisible by --pipeline-model-parallel-size {pp}: use a global batch that gives a "
            f"multiple of {pp}")
    chunks = tuple(rank_chunk_layers(num_layers, pp, v))
    return chunked_stage_layers(chunks), chunks


def context_parallel_chunk_length(seq_length: int, cp_size: int) -> int:
    """c = s / 2·cp: context parallelism cuts each sequence into 2·cp equal chunks, CP rank r holding chunks r and
    2·cp - 1 - r (equal causal work; context_parallel/chunks.py)."""
    if seq_length % (2 * cp_size):
        raise LayoutError(f"--context-parallel-size {cp_size} cuts --seq-length {seq_length} into {2 * cp_size} equal "
                          f"chunks (two per CP rank, for equal causal work): use a sequence length divisible by "
                          f"{2 * cp_size}")
    return seq_length // (2 * cp_size)


def _check_sequence_split(dims: ParallelDims, seq_length: int, sequence_parallel: bool) -> None:
    """CP: 2·cp equal chunks; SP (in effect at TP > 1): each rank's s/cp tokens split over TP."""
    cp, tp = dims.cp_size, dims.tp_size
    if cp > 1:
        context_parallel_chunk_length(seq_length, cp)
    local = seq_length // cp
    if sequence_parallel and tp > 1 and local % tp:
        if cp == 1:
            raise LayoutError(f"--sequence-parallel splits --seq-length {seq_length} over --tensor-model-parallel-"
                              f"size {tp}: use a sequence length divisible by {tp}")
        raise LayoutError(f"--sequence-parallel splits each CP rank's {local} tokens (--seq-length {seq_length} / "
                          f"--context-parallel-size {cp}) over --tensor-model-parallel-size {tp}: use a sequence "
                          f"length divisible by {math.lcm(2 * cp, cp * tp)}")


def heads_per_tp_rank(num_attention_heads: int, tp_size: int) -> int:
    """The attention heads each TP rank holds: TP splits attention by whole heads."""
    if num_attention_heads % tp_size:
        raise LayoutError(f"--num-attention-heads {num_attention_heads} is not divisible by "
                          f"--tensor-model-parallel-size {tp_size}: TP splits attention by heads")
    return num_attention_heads // tp_size


def kv_groups_per_tp_rank(num_attention_heads: int, num_query_groups: int, tp_size: int) -> int:
    """The key-value groups each TP rank holds under grouped-query attention: whole groups, each with its query heads.
    A TP size above the groups is refused (as Megatron does) rather than replicating groups across ranks."""
    if num_attention_heads % num_query_groups:
        raise LayoutError(f"--num-query-groups {num_query_groups} does not divide --num-attention-heads "
                          f"{num_attention_heads}: each key-value group serves a whole number of query heads")
    if num_query_groups % tp_size:
        largest = math.gcd(num_query_groups, tp_size)
        raise LayoutError(f"--num-query-groups {num_query_groups} is not divisible by --tensor-model-parallel-size "
                          f"{tp_size}: TP splits attention by whole key-value groups (none is replicated); the "
                          f"largest TP size for {num_query_groups} groups here is {largest}")
    return num_query_groups // tp_size
