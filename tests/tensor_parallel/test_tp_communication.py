"""What crosses the wire: collectives are counted inside each rank by the library's CommCounter, which wraps
torch.distributed and records (op, group name, bytes); an all-reduce of N bytes counts 2N."""

import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from codegeex_train.accounting import CommCounter
from codegeex_train.tensor_parallel import (
    MODEL_PARALLEL_RNG,
    ColumnParallelLinear,
    RowParallelLinear,
    model_parallel_seed,
    reduce_from_tensor_model_parallel_region,
    vocab_parallel_cross_entropy,
)
from tests.harness import RankFailure, run_distributed

pytestmark = pytest.mark.slow  # every test in this file is in the slow tier (tests/conftest.py)

B, S, H = 2, 8, 16
FP32 = 4  # bytes per element: CommCounter counts bytes, not elements


def count_mlp(topo):
    column = ColumnParallelLinear(H, 4 * H, topo.tp_group, gather_output=False)
    row = RowParallelLinear(4 * H, H, topo.tp_group, input_is_parallel=True)
    x = torch.randn(B, S, H, requires_grad=True)
    with CommCounter(topo.named_groups(), record=True) as comm:
        y = row(F.gelu(column(x)))
        forward = list(comm.calls)
        y.sum().backward()
        backward = comm.calls[len(forward):]
    return forward, backward


@pytest.mark.parametrize("tp", [2, 4])
def test_parallel_mlp_one_all_reduce_each_way(tp):
    # Seed 000: an MLP moves 4*phi per layer, phi = b*s*h: one all-reduce (2*phi) forward, one backward.
    phi = B * S * H * FP32
    for forward, backward in run_distributed(count_mlp, world_size=tp, tp_size=tp):
        assert forward == [("all_reduce", "tp", 2 * phi)]
        assert backward == [("all_reduce", "tp", 2 * phi)]


def count_cross_entropy(topo, vocab):
    logits = torch.randn(B, S, vocab // topo.tp_size, requires_grad=True)
    target = torch.randint(0, vocab, (B, S))
    with CommCounter(topo.named_groups(), record=True) as comm:
        vocab_parallel_cross_entropy(logits, target, topo.tp_group).sum().backward()
    return comm.calls


def test_vocab_parallel_cross_entropy_moves_per_token_numbers_only():
    small = run_distributed(count_cross_entropy, world_size=2, tp_size=2, vocab=64)
    large = run_distributed(count_cross_entropy, world_size=2, tp_size=2, vocab=4096)
    for calls in small + large:
        assert {(op, group) for op, group, _ in calls} == {("all_reduce", "tp")}
        # row max, then sum-exp and target logit together: 3 fp32 numbers per token, all-reduced (2x)
        assert sum(n for _, _, n in calls) <= 2 * 3 * B * S * FP32
    assert small == large, "traffic must not grow with the vocabulary"


def compare_dropout_masks(topo):
    tracker = model_parallel_seed(1234, topo.tp_rank)
    ones = torch.ones(1000)
    replicated = F.dropout(ones, 0.5)  # default stream: same on every TP rank
    with tracker.fork(MODEL_PARALLEL_RNG):
        sharded = F.dropout(ones, 0.5)  # TP stream: differs per TP rank
    again = F.dropout(ones, 0.5)
    masks = [torch.empty_like(ones) for _ in range(topo.tp_size)]
    out = {}
    for name, mask in (("replicated", replicated), ("sharded", sharded), ("again", again)):
        dist.all_gather(masks, mask, group=topo.tp_group)
        out[name] = [m.numpy().copy() for m in masks]
    # The fork must not disturb the default stream: 'again' equals a fresh run without the fork.
    torch.manual_seed(1234)
    F.dropout(ones, 0.5)
    assert torch.equal(again, F.dropout(ones, 0.5))
    return out


def test_rng_tracker_masks():
    masks = run_distributed(compare_dropout_masks, world_size=2, tp_size=2)[0]
    assert np.array_equal(masks["replicated"][0], masks["replicated"][1])
    assert np.array_equal(masks["again"][0], masks["again"][1])
    assert not np.array_equal(masks["sharded"][0], masks["sharded"][1])
    assert not np.array_equal(masks["sharded"][0], masks["replicated"][0])


def g_in_place(topo):
    g = reduce_from_tensor_model_parallel_region
    rank, weights = topo.tp_rank, torch.arange(6.0).view(2, 3)
    x = torch.full((2, 3), rank + 1.0, requires_grad=True)
    partial = x * 2  # an intermediate nothing saved: reduced where it lies
    ptr = partial.data_ptr()
    y = g(partial, topo.tp_group)
    (y * weights).sum().backward()
    out = {"rank": rank, "in_place": y.data_ptr() == ptr, "sum": y.detach().numpy().copy(),
           "x_grad": x.grad.numpy().copy()}
    leaf = torch.full((2, 3), rank + 1.0, requires_grad=True)  # cannot change in place: a copy is reduced
    out["leaf_sum"] = g(leaf, topo.tp_group).detach().numpy().copy()
    out["leaf_kept"] = leaf.detach().numpy().copy()
    saved = torch.full((2, 3), rank + 1.0, requires_grad=True).exp()  # exp keeps its output for backward
    try:
        g(saved, topo.tp_group).sum().backward()
        out["version_error"] = None
    except RuntimeError as e:
        out["version_error"] = str(e)
    return out


def test_g_all_reduces_in_place_without_a_copy():
    for r in run_distributed(g_in_place, world_size=2, tp_size=2):
        assert r["in_place"]  # no clone of the row-parallel output (Megatron reduces it in place too)
        assert np.array_equal(r["sum"], np.full((2, 3), 2.0 + 4.0))
        assert np.array_equal(r["x_grad"], 2 * np.arange(6.0).reshape(2, 3))  # backward: identity
        assert np.array_equal(r["leaf_sum"], np.full((2, 3), 3.0))
        assert np.array_equal(r["leaf_kept"], np.full((2, 3), r["rank"] + 1.0))
        assert r["version_error"] and "inplace" in r["version_error"]  # a producer that saved it is caught


def fail_on_rank_one(topo):
    if topo.rank == 1:
        raise RuntimeError("boom on purpose")
    dist.barrier()  # rank 0 waits for a peer that is gone: must be cut short, not hang


def test_harness_reports_failing_rank():
    with pytest.raises(RankFailure, match=r"(?s)rank 1.*boom on purpose"):
        run_distributed(fail_on_rank_one, world_size=2, collective_timeout_s=5, deadline_s=60)


def hang_on_rank_zero(topo):
    if topo.rank == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins
    else:
        # Stay alive without joining: a rank that returned would close its connections, and rank 0 would fail
        # with gloo's "Connection closed by peer" instead of the time-out under test.
        time.sleep(60)
    return topo.rank


def test_harness_times_out_instead_of_hanging():
    # Rank 0 must fail with gloo's time-out at the harness's collective_timeout_s (3000 ms), not with any other
    # error, and the silent rank 1 must be killed (it would otherwise sleep 60 s, past the 30 s deadline).
    with pytest.raises(RankFailure, match=r"(?s)ranks \[1\] did not finish.*--- rank 0 ---.*"
                                          r"RuntimeError: \S*gloo\S* Timed out waiting 3000ms"):
        run_distributed(hang_on_rank_zero, world_size=2, collective_timeout_s=3, deadline_s=30)
