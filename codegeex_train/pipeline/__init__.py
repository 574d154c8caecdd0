"""Pipeline parallelism (the layer split per stage is ``layout/stages.py``): point-to-point between neighbour stages (p2p.py;
interleaved 1F1B's tagged transfers on the ring), the 1F1B / interleaved 1F1B / no-pipelining / forward-only
schedules as pure functions, their pairing with transfers and their executor (schedules.py), their replay against
the data dependencies (simulate.py: deadlock, bubble, activations in flight), and the tied-embedding gradient sum
under ZeRO-2 (shared_embedding.py).

May import: ``distributed`` (the topology's groups), ``layout``; nothing above it."""

from codegeex_train.pipeline.p2p import P2PCommunicator, Transfer
from codegeex_train.pipeline.schedules import (
    ChunkedPipelineStage,
    Exchange,
    Op,
    PipelineStage,
    ScheduleStats,
    Step,
    forward_only,
    interleaved_one_f_one_b,
    no_pipelining,
    one_f_one_b,
    run_schedule,
    with_p2p_ops,
)
from codegeex_train.pipeline.shared_embedding import (
    allreduce_shared_embedding_grads,
    mark_shared_embedding_copy,
    sync_shared_embedding,
)
from codegeex_train.pipeline.simulate import PipelineDeadlock, Timeline, dependencies, peak_in_flight, simulate
from codegeex_train.layout.stages import stage_layer_counts, stage_layer_ranges

__all__ = [
    "P2PCommunicator",
    "Transfer",
    "ChunkedPipelineStage",
    "Exchange",
    "Op",
    "PipelineStage",
    "ScheduleStats",
    "Step",
    "forward_only",
    "interleaved_one_f_one_b",
    "no_pipelining",
    "one_f_one_b",
    "run_schedule",
    "with_p2p_ops",
    "PipelineDeadlock",
    "Timeline",
    "dependencies",
    "peak_in_flight",
    "simulate",
    "allreduce_shared_embedding_grads",
    "mark_shared_embedding_copy",
    "sync_shared_embedding",
    "stage_layer_counts",
    "stage_layer_ranges",
]
