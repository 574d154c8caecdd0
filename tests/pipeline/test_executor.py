"""The 1F1B executor on 4 real gloo ranks: the order of every forward, backward, send and receive, the
activations each stage really holds, and gradients equal to a dense single-process chain."""

import weakref

import pytest
import torch
from pipeline_helpers import SHAPE, Saved, microbatch

from codegeex_train.pipeline import P2PCommunicator, ScheduleStats, one_f_one_b, run_schedule, with_p2p_ops
from tests.harness import run_distributed

pytestmark = pytest.mark.slow  # every test in this file is in the slow tier (tests/conftest.py)


def expected_1f1b(p, s, m):
    """Megatron's 1F1B loop written out: warm-up, steady (combined transfers), cool-down."""
    first, last, w, ev = s == 0, s == p - 1, min(p - s - 1, m), []
    for i in range(w):
        ev += ([] if first else [("recv_forward", i)]) + [("forward", i)] + ([] if last else [("send_forward", i)])
    if m > w and not first:
        ev.append(("recv_forward", w))
    for k in range(m - w):
        ev.append(("forward", w + k))
        if not last:
            ev += [("send_forward", w + k), ("recv_backward", k)]
        ev.append(("backward", k))
        if not first:
            ev.append(("send_backward", k))
            if k < m - w - 1:
                ev.append(("recv_forward", w + k + 1))
    for k in range(m - w, m):
        ev += ([] if last else [("recv_backward", k)]) + [("backward", k)] + ([] if first else [("send_backward", k)])
    return ev


def stage_weight(s):
    return torch.randn(SHAPE[-1], SHAPE[-1], generator=torch.Generator().manual_seed(s)) / 3


class ChainStage:
    """y = tanh(x W_s); the last stage's loss is mean(y^2) / m."""

    def __init__(self, s, p, m):
        self.first, self.last, self.m = s == 0, s == p - 1, m
        self.weight = stage_weight(s).requires_grad_()
        self.saved, self.peak = {}, 0

    def forward_step(self, mb, x):
        x = microbatch(mb) if self.first else x.requires_grad_()
        refs = self.saved[mb] = []

        def pack(t):
            holder = Saved(t)
            refs.append(weakref.ref(holder))
            return holder

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda h: h.t):
            y = torch.tanh(x @ self.weight)
            out = (y * y).mean() / self.m if self.last else y
        # Measured: micro-batches whose autograd graph still holds saved activations.
        self.peak = max(self.peak, sum(any(r() is not None for r in rs) for rs in self.saved.values()))
        return out

    def backward_step(self, mb, x, out, out_grad):
        torch.autograd.backward(out, out_grad)
        return None if self.first else x.grad


def run_chain(topology, m):
    p, s = topology.pp_size, topology.pp_rank
    log = []
    comm = P2PCommunicator.for_topology(topology, SHAPE, torch.float32, torch.device("cpu"), log=log)
    stage = ChainStage(s, p, m)
    run_schedule(with_p2p_ops(one_f_one_b(p, s, m), s == 0, s == p - 1), stage, comm, ScheduleStats(log=log))
    # Dense reference in this process: the whole chain, every micro-batch.
    weights = [stage_weight(i).requires_grad_() for i in range(p)]
    for i in range(m):
        y = microbatch(i)
        for w in weights:
            y = torch.tanh(y @ w)
        ((y * y).mean() / m).backward()
    return {"log": log, "peak": stage.peak, "grad": stage.weight.grad.numpy(), "ref_grad": weights[s].grad.numpy(),
            "p2p_bytes": comm.bytes_sent}


@pytest.mark.parametrize("m", [8, 3])
def test_1f1b_order_memory_and_gradients(m):
    p = 4
    results = run_distributed(run_chain, world_size=p, pp_size=p, m=m)
    for s, r in enumerate(results):
        assert r["log"] == expected_1f1b(p, s, m), s
        assert r["peak"] == min(p - s, m), (s, r["peak"])  # no more than PP - stage micro-batches held
        torch.testing.assert_close(r["grad"], r["ref_grad"], rtol=1e-6, atol=1e-7)
        # every micro-batch's activation goes down and its gradient comes up once: (b, s, h) fp32 each
        sends = (s < p - 1) + (s > 0)
        assert r["p2p_bytes"] == sends * m * 2 * 3 * 8 * 4
