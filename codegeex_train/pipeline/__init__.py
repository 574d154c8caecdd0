"""Pipeline parallelism: stage splits, point-to-point, schedules (1F1B), the tied-embedding hook."""

from .p2p import P2PCommunicator
from .schedules import (
    Op,
    PipelineStage,
    ScheduleStats,
    Step,
    communication_plan,
    forward_only,
    no_pipelining,
    one_f_one_b,
    run_schedule,
)
from .shared_embedding import allreduce_shared_embedding_grads, mark_shared_embedding_copy, sync_shared_embedding
from .stages import PipelineSplitError, stage_layer_counts, stage_layer_ranges

__all__ = [
    "P2PCommunicator",
    "Op",
    "PipelineStage",
    "ScheduleStats",
    "Step",
    "communication_plan",
    "forward_only",
    "no_pipelining",
    "one_f_one_b",
    "run_schedule",
    "allreduce_shared_embedding_grads",
    "mark_shared_embedding_copy",
    "sync_shared_embedding",
    "PipelineSplitError",
    "stage_layer_counts",
    "stage_layer_ranges",
]
