"""``run_distributed`` (tests/harness.py over distributed/spawn.py) given a plan instead of the sizes: the ranks are
laid out as the plan's dims and every rank's function gets the plan; a plan and sizes together are refused. (What a
rank returns: tests/test_testing.py.)"""

import pytest

from tests.harness import run_distributed
from codegeex_train.layout.dims import ParallelDims
from codegeex_train.layout.plan import ParallelPlan


def coordinates(topology, plan, tag):
    return (topology.dims == plan.dims, topology.tp_rank, topology.dp_rank, plan.global_batch_size, tag)


def test_a_plan_lays_out_the_ranks_and_reaches_every_rank():
    plan = ParallelPlan.derive(ParallelDims(4, tp_size=2), micro_batch_size=1, global_batch_size=4)
    assert run_distributed(coordinates, plan=plan, tag="x") == [(True, r % 2, r // 2, 4, "x") for r in range(4)]


def test_a_plan_and_sizes_together_are_refused():
    plan = ParallelPlan.derive(ParallelDims(2), micro_batch_size=1)
    with pytest.raises(TypeError, match="a plan or the sizes, not both"):
        run_distributed(coordinates, 2, plan=plan, tag="x")
    with pytest.raises(TypeError, match="world_size"):
        run_distributed(coordinates, tag="x")
