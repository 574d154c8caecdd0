"""Megatron's interleaved 1F1B as a pure function (issue 23), checked against its definition and replayed against
the pipeline's data dependencies: every (micro-batch, chunk) runs once each way, nothing deadlocks, the bubble is
(p - 1)/(v·m) of the compute time, and rank r holds min(2·(p - r - 1) + (v - 1)·p + 1, m·v) chunk activations."""

import pytest

from codegeex_train.pipeline import (
    PipelineDeadlock,
    Step,
    interleaved_one_f_one_b,
    one_f_one_b,
    peak_in_flight,
    simulate,
    with_p2p_ops,
)

CASES = [(2, 2, 4), (4, 2, 8), (2, 3, 4), (4, 2, 4), (4, 3, 12)]  # (p, v, m)


def warmup(p, r, m, v):
    return min(2 * (p - r - 1) + (v - 1) * p, m * v)


def megatron_order(p, v, m):
    """(mb, chunk) in forward order: each group of p micro-batches through chunk 0, then chunk 1, ... then the next
    group (Megatron's schedule table with groups of p)."""
    return [(mb, c) for g in range(m // p) for c in range(v) for mb in range(g * p, (g + 1) * p)]


def text(steps):
    return " ".join(f"{s.kind}{s.mb}.{s.chunk}" for s in steps)


def wrong(p, r, m, v, mistake):
    """The schedule with one deliberate mistake, to show the checks below catch it."""
    def at(kind, k):
        c = (k // p) % v
        if kind == "F" and mistake == "forward chunks reversed" or kind == "B" and mistake != "backward in order":
            c = v - 1 - c
        return Step(kind, (k // (p * v)) * p + k % p, c)
    w = {"1F1B warm-up": min(p - r - 1, m * v), "one warm-up forward short": max(warmup(p, r, m, v) - 1, 0)}.get(
        mistake, warmup(p, r, m, v))
    steps = [at("F", k) for k in range(w)]
    for i in range(m * v - w):
        steps += [at("F", w + i), at("B", i)]
    return steps + [at("B", k) for k in range(m * v - w, m * v)]


@pytest.mark.parametrize("p,v,m", CASES)
def test_definition(p, v, m):
    order = megatron_order(p, v, m)
    for r in range(p):
        steps = interleaved_one_f_one_b(p, r, m, v)
        w, total = warmup(p, r, m, v), m * v
        # warm-up forwards, then one forward one backward, then the backwards still owed
        assert "".join(s.kind for s in steps) == "F" * w + "FB" * (total - w) + "B" * w, (p, v, m, r)
        # forwards in Megatron's (micro-batch, chunk) order, backwards the same groups through the chunks reversed
        assert [(s.mb, s.chunk) for s in steps if s.kind == "F"] == order
        assert [(s.mb, s.chunk) for s in steps if s.kind == "B"] == [(mb, v - 1 - c) for mb, c in order]
        # every (micro-batch, chunk) once each way, its backward after its forward
        forwards = {(s.mb, s.chunk): i for i, s in enumerate(steps) if s.kind == "F"}
        backwards = {(s.mb, s.chunk): i for i, s in enumerate(steps) if s.kind == "B"}
        assert len(steps) == 2 * total and set(forwards) == set(backwards) == {(b, c) for b in range(m)
                                                                               for c in range(v)}
        assert all(forwards[key] < backwards[key] for key in forwards)
        # activations held at once: the warm-up's plus the steady forward's
        assert peak_in_flight(steps) == min(2 * (p - r - 1) + (v - 1) * p + 1, m * v)


def test_worked_example_p2_v2_m4():
    # Hand-derived: rank 0 warms up with 2·1 + 1·2 = 4 forwards, rank 1 with 0 + 2 = 2.
    assert text(interleaved_one_f_one_b(2, 0, 4, 2)) == (
        "F0.0 F1.0 F0.1 F1.1 "
        "F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 "
        "B2.1 B3.1 B2.0 B3.0")
    assert text(interleaved_one_f_one_b(2, 1, 4, 2)) == (
        "F0.0 F1.0 "
        "F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 "
        "B2.0 B3.0")


def test_m_equal_p_first_ranks_all_warmup():
    # Current Megatron: the warm-up is capped at m·v; only the ranks whose formula reaches it run all forwards first
    # (older Megatron made every rank all-warm-up when m == p: the same bubble, more activations on the last ranks).
    assert [warmup(4, r, 4, 2) for r in range(4)] == [8, 8, 6, 4]
    assert [peak_in_flight(interleaved_one_f_one_b(4, r, 4, 2)) for r in range(4)] == [8, 8, 7, 5]


@pytest.mark.parametrize("p,m", [(1, 3), (2, 2), (2, 5), (4, 4), (4, 8), (4, 3), (8, 3)])
def test_one_chunk_is_one_f_one_b(p, m):
    for r in range(p):
        assert interleaved_one_f_one_b(p, r, m, 1) == one_f_one_b(p, r, m)


@pytest.mark.parametrize("p,v,m", CASES)
def test_replay_bubble(p, v, m):
    """Unit-time forward, 2-unit backward per chunk; 1F1B on the same work (a stage = v chunks: v and 2v). Asserted:
    interleaved idle/busy == (p-1)/(v·m) and idle/total == (p-1)/(v·m+p-1) (1e-9), 1F1B's idle/total ==
    (p-1)/(m+p-1), and the interleaved idle/total strictly below 1F1B's."""
    interleaved = simulate([interleaved_one_f_one_b(p, r, m, v) for r in range(p)], 1.0, 2.0)
    plain = simulate([one_f_one_b(p, r, m) for r in range(p)], float(v), 2.0 * v)
    assert interleaved.busy == plain.busy == [3.0 * m * v] * p
    assert interleaved.bubble_ratio == pytest.approx((p - 1) / (v * m), abs=1e-9)
    assert interleaved.idle_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-9)
    assert plain.idle_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-9)
    assert interleaved.idle_fraction < plain.idle_fraction
    assert interleaved.makespan == pytest.approx(3.0 * (m * v + p - 1))


def test_replay_one_f_one_b_timeline():
    # 1F1B, p = 2, m = 2, by hand: stage 0 runs F0 F1 B0 B1, stage 1 F0 B0 F1 B1. Stage 1 waits for stage 0's
    # F0 (t 1), its F1 for its own B0 (t 4); stage 0's B0 waits for stage 1's B0 (t 4), its B1 for stage 1's (t 7).
    timeline = simulate([one_f_one_b(2, r, 2) for r in range(2)], 1.0, 2.0)
    assert timeline.starts == [[0, 1, 4, 7], [1, 2, 4, 5]]
    assert timeline.makespan == 9 and timeline.idle == 6  # 6 / 18 = (p - 1)/(m + p - 1)


@pytest.mark.parametrize("mistake", ["forward chunks reversed", "backward in order", "1F1B warm-up",
                                     "one warm-up forward short"])
@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (4, 3, 12)])
def test_mistakes_deadlock(p, v, m, mistake):
    with pytest.raises(PipelineDeadlock, match="waits for"):
        simulate([wrong(p, r, m, v, mistake) for r in range(p)])


def test_replay_refuses_a_repeated_step():
    with pytest.raises(ValueError, match="repeats"):
        simulate([[Step("F", 0), Step("F", 0), Step("B", 0)]])


@pytest.mark.parametrize("args,message", [
    ((4, 0, 6, 2), "divisible by the pipeline size"),
    ((2, 1, 4, 0), "num_chunks must be at least 1"),
    ((2, 0, 4, -1), "num_chunks must be at least 1"),
    ((1, 0, 4, 2), "need a pipeline"),
    ((2, 2, 4, 2), "not in 0..1"),
    ((2, 0, 0, 2), "num_microbatches must be at least 1"),
])
def test_bad_input(args, message):
    with pytest.raises(ValueError, match=message):
        interleaved_one_f_one_b(*args)


def test_p2p_pairing_refuses_chunks():
    # with_p2p_ops keys transfers by micro-batch alone; interleaved steps would be mis-paired silently.
    with pytest.raises(ValueError, match="chunk-aware"):
        with_p2p_ops(interleaved_one_f_one_b(2, 0, 4, 2), True, False)
    assert with_p2p_ops([Step("F", 0, 0), Step("B", 0, 0)], True, True) == with_p2p_ops(one_f_one_b(1, 0, 1),
                                                                                       True, True)
