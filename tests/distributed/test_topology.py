"""The rank layout is a pure function: checked against seed 000's 16-rank example, no process group."""

import json
import subprocess
import sys

import pytest

from codegeex_train.distributed.topology import build_rank_groups, warn_if_tp_spans_nodes
from codegeex_train.layout.dims import ParallelDims
from codegeex_train.layout.errors import LayoutError

# Seed document 000, world 16, TP 2, PP 4 (DP 2), written out as it lists them.
SEED_16 = {
    "mp": [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]],
    "tp": [[0, 1], [4, 5], [8, 9], [12, 13], [2, 3], [6, 7], [10, 11], [14, 15]],
    "pp": [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]],
    "dp": [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
    # first and last stage of every pipeline share the tied word embedding
    "embedding": [[0, 12], [1, 13], [2, 14], [3, 15]],
}

# World 24, TP 2, PP 3 -> DP 4; a stage is 8 consecutive ranks. Written out by hand.
EXPECTED_24 = {
    "tp": [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15], [16, 17], [18, 19],
           [20, 21], [22, 23]],
    "dp": [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15], [16, 18, 20, 22], [17, 19, 21, 23]],
    "pp": [[0, 8, 16], [1, 9, 17], [2, 10, 18], [3, 11, 19], [4, 12, 20], [5, 13, 21], [6, 14, 22], [7, 15, 23]],
    "mp": [[0, 1, 8, 9, 16, 17], [2, 3, 10, 11, 18, 19], [4, 5, 12, 13, 20, 21], [6, 7, 14, 15, 22, 23]],
    "embedding": [[0, 16], [1, 17], [2, 18], [3, 19], [4, 20], [5, 21], [6, 22], [7, 23]],
}


def _as_sets(groups):
    # The seed lists groups in a different order than Megatron creates them; members are ordered.
    return sorted(map(tuple, groups))


@pytest.mark.parametrize("world,tp,pp,expected", [(16, 2, 4, SEED_16), (24, 2, 3, EXPECTED_24)])
def test_layout_matches_megatron(world, tp, pp, expected):
    groups = build_rank_groups(ParallelDims(world, tp, pp)).as_dict()
    assert set(groups) == set(expected)
    for kind in expected:
        assert _as_sets(groups[kind]) == _as_sets(expected[kind]), kind


@pytest.mark.parametrize("world,tp,pp", [(1, 1, 1), (8, 2, 2), (16, 2, 4), (24, 2, 3), (12, 3, 2), (8, 8, 1)])
def test_layout_invariants(world, tp, pp):
    dims = ParallelDims(world, tp, pp)
    g = build_rank_groups(dims)
    for kind, size in (("tp", tp), ("pp", pp), ("dp", dims.dp_size), ("mp", tp * pp)):
        groups = getattr(g, kind)
        assert all(len(x) == size for x in groups)
        assert sorted(r for x in groups for r in x) == list(range(world)), f"{kind} groups partition the world"
    for rank in range(world):
        t, d, p = dims.coords(rank)
        assert dims.rank_of(t, d, p) == rank
        assert g.tp[[rank in x for x in g.tp].index(True)][t] == rank
    assert all(x == list(range(x[0], x[0] + tp)) for x in g.tp), "TP groups are contiguous"


@pytest.mark.parametrize("world,tp,pp,flag", [
    (16, 3, 1, "--tensor-model-parallel-size 3"),
    (16, 2, 3, "--pipeline-model-parallel-size 3"),
    (8, 0, 1, "--tensor-model-parallel-size=0"),
])
def test_invalid_sizes_name_the_numbers_and_flag(world, tp, pp, flag):
    with pytest.raises(LayoutError, match=flag) as e:
        ParallelDims(world, tp, pp)
    if tp:
        assert str(world) in str(e.value)


def test_tp_group_spanning_nodes_warns():
    with pytest.warns(UserWarning, match="span nodes"):
        assert warn_if_tp_spans_nodes(ParallelDims(12, 3, 1), gpus_per_node=4)
    assert warn_if_tp_spans_nodes(ParallelDims(16, 8, 2), gpus_per_node=8) == []


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "codegeex_train.distributed.topology", *args], capture_output=True, text=True)


@pytest.mark.slow
def test_cli_json_and_text():
    out = _cli("--world-size", "16", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "4",
               "--json")
    assert out.returncode == 0, out.stderr
    groups = json.loads(out.stdout)
    assert {k: _as_sets(v) for k, v in groups.items()} == {k: _as_sets(v) for k, v in SEED_16.items()}
    text = _cli("--world-size", "16", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "4",
                "--gpus-per-node", "4")
    assert "rank   15: node 3" in text.stdout and "span" not in text.stderr
    bad = _cli("--world-size", "12", "--tensor-model-parallel-size", "3", "--gpus-per-node", "4")
    assert bad.returncode == 0 and "span nodes" in bad.stderr
    err = _cli("--world-size", "10", "--tensor-model-parallel-size", "4")
    assert err.returncode != 0 and "--tensor-model-parallel-size 4" in err.stderr
