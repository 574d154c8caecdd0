"""ModelGroups (model/groups.py): the one bundle of process groups the model's constructors take, checked against the
plan once; no process group needed (torch.distributed's size and rank answer for stand-in groups)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch.distributed as dist
from model_helpers import model_plan, tiny_config

from codegeex_train.layout.dims import ParallelDims
from codegeex_train.layout.recompute import Recompute
from codegeex_train.model import CodeGeeXModel, ModelGroups

TP, CP = object(), object()  # stand-ins for a TP group of 2 and a CP group of 4, this rank 1 in each


@pytest.fixture
def sized(monkeypatch):
    monkeypatch.setattr(dist, "get_world_size", lambda g=None: {id(TP): 2, id(CP): 4}[id(g)])
    monkeypatch.setattr(dist, "get_rank", lambda g=None: 1)


def test_no_groups_is_one_rank():
    groups = ModelGroups()
    assert (groups.tp_size, groups.tp_rank, groups.cp_size, groups.cp_rank) == (1, 0, 1, 0)
    groups.check(model_plan(sequence_parallel=True))  # SP at TP 1 is not in effect: nothing to check it against
    assert groups.sequence_parallel_group(model_plan(sequence_parallel=True)) is None


def test_from_topology_takes_the_tp_and_cp_groups(sized):
    groups = ModelGroups.from_topology(SimpleNamespace(tp_group=TP, cp_group=CP, pp_group=object()))
    assert groups == ModelGroups(tp=TP, cp=CP)
    assert (groups.tp_size, groups.tp_rank, groups.cp_size, groups.cp_rank) == (2, 1, 4, 1)


def test_the_sequence_parallel_group_is_tps_when_the_plan_has_sp(sized):
    groups = ModelGroups(tp=TP)
    assert groups.sequence_parallel_group(model_plan(ParallelDims(2, 2), sequence_parallel=True)) is TP
    assert groups.sequence_parallel_group(model_plan(ParallelDims(2, 2))) is None


@pytest.mark.parametrize("groups,dims", [
    (ModelGroups(tp=TP), ParallelDims(2, 2)),
    (ModelGroups(tp=TP, cp=CP), ParallelDims(8, 2, cp_size=4)),
    (ModelGroups(cp=CP), ParallelDims(4, cp_size=4)),
])
def test_the_plans_groups_pass(sized, groups, dims):
    groups.check(model_plan(dims))


@pytest.mark.parametrize("groups,dims,says", [
    (ModelGroups(tp=TP), ParallelDims(4, 4), "a TP group of 2, no CP group"),  # another TP size
    (ModelGroups(), ParallelDims(2, 2), "a TP group of 1"),
    (ModelGroups(tp=TP, cp=CP), ParallelDims(2, 2), "a CP group of 4"),  # CP group, plan without CP
    (ModelGroups(tp=TP), ParallelDims(8, 2, cp_size=4), "(TP 2, CP 4)"),  # plan with CP, no CP group
    (ModelGroups(tp=TP, cp=CP), ParallelDims(4, 2, cp_size=2), "(TP 2, CP 2)"),  # another CP size
])
def test_groups_that_are_not_the_plans_are_refused(sized, groups, dims, says):
    with pytest.raises(ValueError, match="are not the plan's") as e:
        groups.check(model_plan(dims))
    assert says in str(e.value)


def test_the_model_checks_its_groups_against_the_plan_before_any_weight(sized):
    with pytest.raises(ValueError, match=r"a TP group of 2, no CP group\) are not the plan's \(TP 1, CP 1\)"):
        CodeGeeXModel(tiny_config(), ModelGroups(tp=TP), model_plan(), device="meta")


def test_the_model_reads_sp_and_recompute_from_the_plan(sized):
    """SP in effect is the plan's ``sp`` (TP > 1); without a plan: TP over the groups, no SP, no recompute."""
    plan = model_plan(ParallelDims(2, 2), sequence_parallel=True, recompute=Recompute.full())
    model = CodeGeeXModel(tiny_config(), ModelGroups(tp=TP), plan, device="meta")
    assert model.sequence_parallel and model.checkpoint_activations and model.plan is plan
    assert model.final_layernorm.sp_group is TP and model.layers["0"].mlp.dense_h_to_4h.sequence_parallel
    assert model.layers["0"].attention.cp_group is None
    bare = CodeGeeXModel(tiny_config(), ModelGroups(tp=TP), device="meta")
    assert (bare.plan.tp_size, bare.plan.cp_size, bare.plan.recompute) == (2, 1, Recompute())
    assert not bare.sequence_parallel and bare.final_layernorm.sp_group is None
    assert not CodeGeeXModel(tiny_config(), None, model_plan(sequence_parallel=True), device="meta").sequence_parallel
