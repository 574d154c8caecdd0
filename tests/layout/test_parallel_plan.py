"""ParallelPlan.derive (codegeex_train/layout/plan.py): every layout rule in one place, one error type naming the
flag; validate, the planner and the memory check ask it. Pure: no process group."""

import pytest

from codegeex_train.config.arguments import ConfigError, parse_args, validate
from codegeex_train.context_parallel import check_context_parallel_length
from codegeex_train.layout.dims import ParallelDims, model_parallel_rank
from codegeex_train.layout.errors import LayoutError
from codegeex_train.layout.plan import ParallelPlan, context_parallel_chunk_length, heads_per_tp_rank
from codegeex_train.layout.recompute import Recompute
from codegeex_train.layout.stages import rank_chunk_layers


def derive(world=8, tp=1, pp=1, cp=1, **kw):
    return ParallelPlan.derive(ParallelDims(world, tp, pp, cp), **{"micro_batch_size": 2, **kw})


def test_micro_batches_per_step_from_the_global_batch():
    plan = derive(world=8, tp=2, global_batch_size=32)  # DP 4: 32 = 2 x m x 4
    assert (plan.num_microbatches, plan.global_batch_size) == (4, 32)
    assert derive(num_microbatches=3).global_batch_size == 2 * 3 * 8
    assert derive(global_batch_size=48, num_microbatches=3).num_microbatches == 3
    assert derive().num_microbatches == 1  # neither: one micro-batch per step
    with pytest.raises(LayoutError, match="--global-batch-size 20 is not divisible by --micro-batch-size 2 x "
                                          "data-parallel size 8 = 16"):
        derive(global_batch_size=20)
    with pytest.raises(LayoutError, match="--num-microbatches 2 disagrees with --global-batch-size 48"):
        derive(global_batch_size=48, num_microbatches=2)


def test_stage_and_chunk_splits():
    assert derive(world=2, pp=2).stage_layers == ()  # no --num-layers: a plan for the batch arithmetic only
    assert derive(world=2, pp=2, num_layers=4).stage_layers == (range(0, 2), range(2, 4))
    uneven = derive(world=3, pp=3, num_layers=10, decoder_first_pipeline_num_layers=2)
    assert uneven.stage_layers == (range(0, 2), range(2, 6), range(6, 10))
    given = derive(world=2, pp=2, num_layers=5, stage_layers=(range(0, 3), range(3, 5)))
    assert given.stage_layers == (range(0, 3), range(3, 5)) and given.num_chunks == 1
    # interleaved 1F1B: the flag (layers per virtual stage) and v say the same
    by_flag = derive(world=2, pp=2, num_microbatches=4, num_layers=8, num_layers_per_virtual_pipeline_stage=2)
    assert by_flag == derive(world=2, pp=2, num_microbatches=4, num_layers=8, num_chunks=2)
    assert by_flag.num_chunks == 2 and by_flag.chunk_layers == tuple(rank_chunk_layers(8, 2, 2))
    assert by_flag.stage_layers == ((0, 1, 4, 5), (2, 3, 6, 7))


@pytest.mark.parametrize("kw,message", [
    (dict(num_layers=5), "--num-layers 5 is not divisible by --pipeline-model-parallel-size 2"),
    (dict(num_layers=5, stage_layers=(range(0, 2), range(3, 6))), "does not hold each of --num-layers 5 once"),
    (dict(num_layers=6, num_chunks=2), "--num-layers 6 is not divisible into"),
    (dict(num_layers=8, num_chunks=2, num_microbatches=3), "micro-batches per step .3 = .* divisible by "
                                                           "--pipeline-model-parallel-size 2"),
    (dict(num_chunks=2), "needs --num-layers"),
])
def test_split_refusals_name_the_flags(kw, message):
    with pytest.raises(LayoutError, match=message):
        derive(world=2, pp=2, **kw)


def test_heads_per_tp_rank():
    assert heads_per_tp_rank(8, 4) == 2 and derive(tp=4, num_attention_heads=8).tp_size == 4
    with pytest.raises(LayoutError, match="--num-attention-heads 6 is not divisible by --tensor-model-parallel-size 4: "
                                          "TP splits attention by heads"):
        derive(tp=4, num_attention_heads=6)


def test_sequence_rules():
    assert context_parallel_chunk_length(64, 2) == 16
    assert derive(seq_length=31).local_seq_length == 31  # CP 1: any length
    plan = derive(world=8, tp=2, cp=2, seq_length=64, sequence_parallel=True, hidden_size=8)
    assert plan.sp and plan.local_seq_length == 32 and plan.p2p_shape == (2, 16, 8)
    assert not derive(seq_length=31, sequence_parallel=True).sp  # SP at TP 1 splits nothing: no rule
    with pytest.raises(LayoutError, match="--context-parallel-size 2 cuts --seq-length 66 into 4 equal chunks"):
        derive(cp=2, seq_length=66)
    with pytest.raises(LayoutError, match="--sequence-parallel splits --seq-length 30 over --tensor-model-parallel-"
                                          "size 4: use a sequence length divisible by 4"):
        derive(tp=4, seq_length=30, sequence_parallel=True)
    with pytest.raises(LayoutError, match="each CP rank's 18 tokens .* divisible by 8"):
        derive(tp=4, cp=2, seq_length=36, sequence_parallel=True)
    # the CP chunks' own check is the same rule
    with pytest.raises(LayoutError, match="cuts --seq-length 10 into 8 equal chunks"):
        check_context_parallel_length(10, 4)


def test_one_error_type():
    for make in (lambda: ParallelDims(8, 3), lambda: derive(world=2, pp=2, num_layers=3),
                 lambda: derive(micro_batch_size=0), lambda: derive(dtype="fp8")):
        with pytest.raises(LayoutError):
            make()


def test_validate_asks_the_plan():
    """validate's plan is derive's, from the same flags; a layout error is validate's ConfigError, the same line."""
    args = parse_args(["--data-path", "x", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                       "--num-layers", "8", "--num-layers-per-virtual-pipeline-stage", "2", "--micro-batch-size", "1",
                       "--global-batch-size", "8", "--seq-length", "64", "--sequence-parallel",
                       "--recompute-granularity", "selective", "--bf16"])
    plan = validate(args, 8)
    assert plan == ParallelPlan.derive(
        ParallelDims(8, 2, 2), micro_batch_size=1, global_batch_size=8, num_layers=8, num_chunks=2,
        sequence_parallel=True, recompute=Recompute("selective"), seq_length=64, hidden_size=args.model.hidden_size,
        dtype="bf16")
    with pytest.raises(LayoutError) as layout:
        derive(world=2, micro_batch_size=4, global_batch_size=10)
    with pytest.raises(ConfigError) as config:
        validate(parse_args(["--data-path", "x", "--micro-batch-size", "4", "--global-batch-size", "10"]), 2)
    assert str(config.value) == str(layout.value)


def test_model_parallel_rank():
    """Checkpoint files are named by it: PP outer, TP inner."""
    assert [model_parallel_rank(t, p, 2) for p in range(2) for t in range(2)] == [0, 1, 2, 3]
