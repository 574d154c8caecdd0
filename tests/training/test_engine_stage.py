"""EngineStage (training/engine_stage.py) takes the plan and this rank's coordinates: the micro-batches, their shape,
the model chunks and the CP split come from the plan. Pure: no engine, no process group."""

import torch

from codegeex_train.context_parallel import split_for_context_parallel
from codegeex_train.layout.dims import ParallelDims, RankCoords
from codegeex_train.layout.plan import ParallelPlan
from codegeex_train.training.engine_stage import ChunkedEngineStage, EngineStage


def test_the_stage_reads_the_plan():
    plan = ParallelPlan.derive(ParallelDims(8, 1, 2, 2), micro_batch_size=2, num_microbatches=4, num_layers=8,
                               num_chunks=2, seq_length=16)
    first = ChunkedEngineStage(None, None, plan, coords=plan.dims.rank_coords(0), device=torch.device("cpu"))
    last = ChunkedEngineStage(None, None, plan, coords=plan.dims.rank_coords(7), device=torch.device("cpu"))
    assert (first.is_first, first.is_last, last.is_first, last.is_last) == (True, False, False, True)
    assert first.num_chunks == last.num_chunks == 2 and first.num_microbatches == 4
    whole = torch.arange(16).repeat(2, 1)
    assert torch.equal(last.positions, split_for_context_parallel(whole, 1, 1, 2))  # CP rank 1's 8 positions
    plain = EngineStage(None, None, ParallelPlan.derive(ParallelDims(1), micro_batch_size=3, seq_length=5),
                        coords=RankCoords(0, 0, 0, 0), device=torch.device("cpu"))
    assert plain.cp is None and plain.is_first and plain.is_last
    assert torch.equal(plain.positions, torch.arange(5).repeat(3, 1))
