"""The Topology's torch.distributed groups and the DeepSpeed mpu adapter, on 8 real gloo ranks."""

import pytest
import torch
import torch.distributed as dist

from codegeex_train.distributed.topology import DeepSpeedMPU
from tests.harness import all_gather_tensor, run_distributed

pytestmark = pytest.mark.slow  # every test in this file is in the slow tier (tests/conftest.py)


def _members(group):
    return [int(t) for t in all_gather_tensor(torch.tensor([dist.get_rank()]), group)]


def describe_rank(topo):
    mpu = DeepSpeedMPU(topo)
    return {
        "coords": (mpu.get_tensor_model_parallel_rank(), mpu.get_data_parallel_rank(),
                   mpu.get_pipeline_model_parallel_rank()),
        "sizes": (mpu.get_tensor_model_parallel_world_size(), mpu.get_data_parallel_world_size(),
                  mpu.get_pipeline_model_parallel_world_size(), mpu.get_model_parallel_world_size()),
        "tp": _members(mpu.get_tensor_model_parallel_group()),
        "dp": _members(mpu.get_data_parallel_group()),
        "pp": _members(mpu.get_pipeline_model_parallel_group()),
        "mp": _members(mpu.get_model_parallel_group()),
        "embedding": _members(topo.embedding_group),
        "mp_rank": mpu.get_model_parallel_rank(),
        "stage": (topo.is_first_stage, topo.is_last_stage, topo.prev_rank, topo.next_rank),
        "src": (topo.tp_src_rank, topo.first_stage_rank, topo.last_stage_rank),
    }


def test_groups_and_mpu_on_eight_ranks():
    # world 8 = TP 2 x DP 2 x PP 2: stage 0 is ranks 0-3, stage 1 ranks 4-7.
    info = run_distributed(describe_rank, world_size=8, tp_size=2, pp_size=2)
    r5 = info[5]  # tp 1, dp 0, pp 1
    assert r5["coords"] == (1, 0, 1) and r5["sizes"] == (2, 2, 2, 4)
    assert r5["tp"] == [4, 5] and r5["dp"] == [5, 7] and r5["pp"] == [1, 5] and r5["mp"] == [0, 1, 4, 5]
    assert r5["embedding"] == [1, 5] and r5["mp_rank"] == 3
    assert r5["stage"] == (False, True, 1, 1) and r5["src"] == (4, 1, 5)
    assert info[2]["coords"] == (0, 1, 0) and info[2]["stage"][:2] == (True, False)
    for rank, r in enumerate(info):
        tp_rank, dp_rank, pp_rank = r["coords"]
        assert rank == (pp_rank * 2 + dp_rank) * 2 + tp_rank
        assert r["tp"][tp_rank] == r["dp"][dp_rank] == r["pp"][pp_rank] == rank
