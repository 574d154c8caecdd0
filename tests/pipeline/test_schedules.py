"""The schedules and the layer split as pure functions: no process group."""

import pytest

from codegeex_train.layout.errors import LayoutError
from codegeex_train.pipeline import (
    Step,
    forward_only,
    no_pipelining,
    one_f_one_b,
    stage_layer_ranges,
    with_p2p_ops,
)


def kinds(steps):
    return "".join(s.kind for s in steps)


@pytest.mark.parametrize("p,m", [(1, 4), (2, 2), (2, 8), (4, 4), (4, 8), (4, 2), (8, 3)])
def test_one_f_one_b_phases(p, m):
    for s in range(p):
        steps = one_f_one_b(p, s, m)
        w = min(p - s - 1, m)
        # warm-up forwards, then alternating F/B, then the backwards still owed
        assert kinds(steps) == "F" * w + "FB" * (m - w) + "B" * w, (p, s, m)
        assert [x.mb for x in steps if x.kind == "F"] == list(range(m))
        assert [x.mb for x in steps if x.kind == "B"] == list(range(m))
        # never a backward before its forward; at most p - s forwards awaiting their backward
        live, peak = set(), 0
        for x in steps:
            if x.kind == "F":
                live.add(x.mb)
                peak = max(peak, len(live))
            else:
                assert x.mb in live
                live.remove(x.mb)
        assert peak == min(p - s, m)


def test_no_pipelining_and_forward_only():
    assert no_pipelining(3) == [Step("F", 0), Step("B", 0), Step("F", 1), Step("B", 1), Step("F", 2), Step("B", 2)]
    assert forward_only(2) == [Step("F", 0), Step("F", 1)]


def test_with_p2p_ops_pairs_sends_with_receives():
    # Stage 1 of 4, 4 micro-batches: Megatron's 1F1B with combined steady-state transfers.
    ops = [(o.kind, o.mb, o.recv_mb) for o in with_p2p_ops(one_f_one_b(4, 1, 4), False, False)]
    assert ops == [
        ("recv_forward", 0, None), ("forward", 0, None), ("send_forward", 0, None),
        ("recv_forward", 1, None), ("forward", 1, None), ("send_forward", 1, None),
        ("recv_forward", 2, None), ("forward", 2, None), ("send_forward_recv_backward", 2, 0),
        ("backward", 0, None), ("send_backward_recv_forward", 0, 3),
        ("forward", 3, None), ("send_forward_recv_backward", 3, 1),
        ("backward", 1, None), ("send_backward", 1, None),
        ("recv_backward", 2, None), ("backward", 2, None), ("send_backward", 2, None),
        ("recv_backward", 3, None), ("backward", 3, None), ("send_backward", 3, None),
    ]
    # The ends do not talk past the pipeline; PP = 1 does not talk at all.
    first = with_p2p_ops(one_f_one_b(4, 0, 4), True, False)
    last = with_p2p_ops(one_f_one_b(4, 3, 4), False, True)
    assert not any("recv_forward" in o.kind or "send_backward" in o.kind for o in first)
    assert not any("send_forward" in o.kind or "recv_backward" in o.kind for o in last)
    assert {o.kind for o in with_p2p_ops(no_pipelining(4), True, True)} == {"forward", "backward"}


def _transfers(ops, kind):
    """Micro-batches moved by ``kind`` (send_forward, recv_backward, ...), combined ops included."""
    out = []
    for o in ops:
        parts = o.kind.split("_recv_")
        if parts[0] == kind:
            out.append(o.mb)
        if len(parts) == 2 and "recv_" + parts[1] == kind:
            out.append(o.recv_mb)
    return out


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 3)])
def test_neighbours_agree_on_every_transfer(p, m):
    ops = [with_p2p_ops(one_f_one_b(p, s, m), s == 0, s == p - 1) for s in range(p)]
    for s in range(p - 1):
        assert _transfers(ops[s], "send_forward") == _transfers(ops[s + 1], "recv_forward") == list(range(m))
        assert _transfers(ops[s + 1], "send_backward") == _transfers(ops[s], "recv_backward") == list(range(m))


def test_layer_split():
    assert stage_layer_ranges(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert stage_layer_ranges(5, 2, first=2) == [range(0, 2), range(2, 5)]
    assert stage_layer_ranges(10, 4, first=1, last=3) == [range(0, 1), range(1, 4), range(4, 7), range(7, 10)]
    assert stage_layer_ranges(39, 4, last=9) == [range(0, 10), range(10, 20), range(20, 30), range(30, 39)]
    assert stage_layer_ranges(3, 1) == [range(0, 3)]


@pytest.mark.parametrize("layers,pp,first,last,message", [
    (5, 2, None, None, "--decoder-first-pipeline-num-layers"),  # no silent uneven split
    (2, 4, None, None, "larger than --num-layers 2"),
    (5, 2, 2, 2, "add up to 4"),
    (10, 4, 1, 2, "positive multiple of 2"),
    (4, 2, 0, None, "at least one layer"),
    (4, 1, 2, None, "--pipeline-model-parallel-size 1"),
])
def test_bad_layer_split(layers, pp, first, last, message):
    with pytest.raises(LayoutError, match=message):
        stage_layer_ranges(layers, pp, first, last)
