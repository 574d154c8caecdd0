"""The interleaved 1F1B executor (issue 23) over real point-to-point.

On real gloo ranks, a chain of p·v fake layers y = tanh(x W_k) (virtual stage k = c·p + r on rank r, chunk c):
every rank's forwards, backwards, sends and receives with their chunk ids, in order, equal Megatron's interleaved
loop written out here; the loss and every W_k's gradient equal a dense single-process chain; the (micro-batch,
chunk) activations each rank really holds at once (weakrefs on what autograd saved) equal the schedule's bound
min(2(p-r-1) + (v-1)p + 1, m·v); and nothing deadlocks (run_distributed's deadline would fail the test).

Without processes, every rank's ops are replayed under gloo's rendezvous semantics (a send completes only once the
peer posted the matching receive; gloo matches by (peer, tag), first posted first): no deadlock, and every send
meets the receive of the right virtual stage, over many (p, v, m); a 1F1B-style pairing, Megatron's untagged post
order at p = 2 and a wrong tag are each caught.
"""

import weakref
from collections import defaultdict

import pytest
import torch
from pipeline_helpers import SHAPE, Saved, microbatch

from codegeex_train.pipeline import (
    Exchange,
    P2PCommunicator,
    ScheduleStats,
    Step,
    Transfer,
    interleaved_one_f_one_b,
    one_f_one_b,
    run_schedule,
    with_p2p_ops,
)
from tests.harness import run_distributed

NBYTES = 2 * 3 * 8 * 4  # one fp32 activation or gradient


def warmup(p, r, m, v):
    return min(2 * (p - r - 1) + (v - 1) * p, m * v)


def expected_interleaved(p, r, m, v):
    """Megatron's interleaved loop (forward_backward_pipelining_with_interleaving) written out for rank r: the
    forwards / backwards and, after each, one batch of transfers posted forward-first (activation out, activation
    in, gradient out, gradient in). The first virtual stage (rank 0, chunk 0) receives no input and sends no input
    gradient; the last (rank p-1, chunk v-1) sends no output and receives no output gradient (its loss starts the
    backward). Where the warm-up takes every forward (w = m·v) the last warm-up batch also receives the first
    backward's gradient (Megatron posts that receive alone, right after). A warm-up of m·v - 1 has the same steps
    and is posted the same way (Megatron: one steady pair); only odd p has one, e.g. (p, v, m) = (3, 2, 3), rank 1."""
    total, w = m * v, warmup(p, r, m, v)
    w = total if w == total - 1 else w

    def fwd(k):  # Megatron's micro-batch and get_model_chunk_id(k, forward=True)
        return (k // (p * v)) * p + k % p, (k // p) % v

    def bwd(k):
        mb, c = fwd(k)
        return mb, v - 1 - c

    ev = []

    def batch(send_f=None, recv_f=None, send_b=None, recv_b=None):
        if send_f is not None and not (r == p - 1 and fwd(send_f)[1] == v - 1):
            ev.append(("send_forward", *fwd(send_f)))
        if recv_f is not None and recv_f < total and not (r == 0 and fwd(recv_f)[1] == 0):
            ev.append(("recv_forward", *fwd(recv_f)))
        if send_b is not None and not (r == 0 and bwd(send_b)[1] == 0):
            ev.append(("send_backward", *bwd(send_b)))
        if recv_b is not None and recv_b < total and not (r == p - 1 and bwd(recv_b)[1] == v - 1):
            ev.append(("recv_backward", *bwd(recv_b)))

    batch(recv_f=0)
    for k in range(w):  # warm-up: send_forward_recv_forward (+ recv_backward for the first backward at the end)
        ev.append(("forward", *fwd(k)))
        batch(send_f=k, recv_f=k + 1, recv_b=0 if k == w - 1 else None)
    for k in range(total - w):  # steady: a forward, a backward, then send_forward_backward_recv_forward_backward
        ev += [("forward", *fwd(w + k)), ("backward", *bwd(k))]
        batch(send_f=w + k, recv_f=w + k + 1, send_b=k, recv_b=k + 1)
    for k in range(total - w, total):  # cool-down: send_backward_recv_backward
        ev.append(("backward", *bwd(k)))
        batch(send_b=k, recv_b=k + 1)
    return ev


def test_expected_sequence_worked_example():
    # p = 2, v = 2, m = 4, rank 1 (the last; warm-up 2), by hand. Rank 1 receives every input from rank 0, sends
    # on only chunk 0's outputs (round to rank 0's chunk 1), receives output gradients only for chunk 0.
    E = {"sf": "send_forward", "rf": "recv_forward", "sb": "send_backward", "rb": "recv_backward", "F": "forward",
         "B": "backward"}
    hand = """rf0.0 | F0.0 | sf0.0 rf1.0 | F1.0 | sf1.0 rf0.1 | F0.1 B0.1 | rf1.1 sb0.1 | F1.1 B1.1 |
              rf2.0 sb1.1 rb0.0 | F2.0 B0.0 | sf2.0 rf3.0 sb0.0 rb1.0 | F3.0 B1.0 | sf3.0 rf2.1 sb1.0 |
              F2.1 B2.1 | rf3.1 sb2.1 | F3.1 B3.1 | sb3.1 rb2.0 | B2.0 | sb2.0 rb3.0 | B3.0 | sb3.0"""
    events = []
    for word in hand.replace("|", " ").split():
        kind, rest = word.rstrip("0123456789.")[:2], word.lstrip("sfrbFB")
        mb, chunk = rest.split(".")
        events.append((E[kind], int(mb), int(chunk)))
    assert expected_interleaved(2, 1, 4, 2) == events


# --- Replay under rendezvous semantics (no processes) ------------------------------------------------------------

class Mismatch(AssertionError):
    pass


class Deadlock(AssertionError):
    pass


def rendezvous_replay(ops, p, v, tag=lambda t: t.tag):
    """Replay every rank's ops (``ops[r]``) as gloo runs them. Each rank's ops are checked to be well formed (a
    forward after its input arrived, a send after the step that made its tensor). Transfers are matched per (sender,
    receiver, tag) in posting order; every match must join a sender's (micro-batch, chunk) to the receiver's next
    virtual stage (forward) or previous one (backward). Then each rank waits on its exchanges in order, an exchange
    completing once every transfer's peer exchange is posted; Deadlock if all remaining ranks wait forever."""
    exchanges = [[op for op in rank_ops if isinstance(op, Exchange)] for rank_ops in ops]
    for r, rank_ops in enumerate(ops):
        have, done = set(), set()
        for op in rank_ops:
            if isinstance(op, Exchange):
                for t in op.transfers:
                    if t.is_send:
                        step = ("F" if t.is_forward else "B", t.mb, t.chunk)
                        assert step in done, f"rank {r} sends {t} before computing it"
                    else:
                        have.add(("F" if t.is_forward else "B", t.mb, t.chunk))
            else:
                step = ("F" if op.kind == "forward" else "B", op.mb, op.chunk)
                virtual_end = (r == 0 and op.chunk == 0) if op.kind == "forward" else (r == p - 1 and
                                                                                     op.chunk == v - 1)
                assert virtual_end or step in have, f"rank {r} runs {op} before its input arrived"
                done.add(step)
    sends, recvs = defaultdict(list), defaultdict(list)  # (src, dst, tag) -> [(exchange index, transfer)]
    for r, rank_exchanges in enumerate(exchanges):
        for e, ex in enumerate(rank_exchanges):
            for t in ex.transfers:
                downstream = t.is_forward == t.is_send  # send_forward / recv_backward talk to the next rank
                peer = (r + 1) % p if downstream else (r - 1) % p
                (sends if t.is_send else recvs)[(r, peer, tag(t)) if t.is_send else (peer, r, tag(t))].append((e, t))
    if {k: len(x) for k, x in sends.items()} != {k: len(x) for k, x in recvs.items()}:
        raise Mismatch(f"sends and receives per (sender, receiver, tag) differ: {dict(sends)} / {dict(recvs)}")
    partners = defaultdict(list)  # (rank, exchange index) -> the (rank, exchange index) of its transfers' peers
    for (src, dst, _), stream in sends.items():
        for (es, s), (er, q) in zip(stream, recvs[(src, dst, _)]):
            if s.is_forward:
                want = Transfer("recv_forward", s.mb, s.chunk + (src == p - 1), q.boundary)
            else:
                want = Transfer("recv_backward", s.mb, s.chunk - (src == 0), q.boundary)
            if (q.kind, q.mb, q.chunk) != (want.kind, want.mb, want.chunk):
                raise Mismatch(f"rank {src}'s {s} was received by rank {dst} as {q} (should be {want})")
            partners[(src, es)].append((dst, er))
            partners[(dst, er)].append((src, es))
    at = [0] * p  # the exchange each rank has posted and waits on (len: finished)
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while at[r] < len(exchanges[r]) and all(at[q] >= e for q, e in partners[(r, at[r])]):
                at[r] += 1
                progress = True
    blocked = [f"rank {r} in {exchanges[r][at[r]]}" for r in range(p) if at[r] < len(exchanges[r])]
    if blocked:
        raise Deadlock("; ".join(blocked))


def interleaved_ops(p, v, m, forward_only=False):
    ops = []
    for r in range(p):
        steps = interleaved_one_f_one_b(p, r, m, v)
        ops.append(with_p2p_ops([s for s in steps if s.kind == "F"] if forward_only else steps, r == 0, r == p - 1,
                                num_chunks=v))
    return ops


GRID = [(p, v, m) for p in (2, 3, 4, 5) for v in (2, 3, 4) for m in (p, 2 * p, 3 * p)]


def events(ops):
    """What the executor and the communicator record for ``ops``, in order."""
    out = []
    for op in ops:
        out += [(t.kind, t.mb, t.chunk) for t in op.transfers] if isinstance(op, Exchange) else [
            (op.kind, op.mb, op.chunk)]
    return out


@pytest.mark.parametrize("p,v,m", GRID)
def test_ops_follow_megatron_loop(p, v, m):
    for r, rank_ops in enumerate(interleaved_ops(p, v, m)):
        assert events(rank_ops) == expected_interleaved(p, r, m, v), (p, v, m, r)


@pytest.mark.parametrize("p,v,m", GRID)
def test_rendezvous_replay(p, v, m):
    """No deadlock and the right routing, with tags; also training-free (forward-only) ops; and, p = 2 included,
    without tags (all 0), which is how a backend that ignores tags (NCCL) would match them: the forward-first post
    order is enough. The capped warm-ups (m·v <= 2(p-1) + (v-1)p, e.g. (4, 2, 4)) are among these."""
    rendezvous_replay(interleaved_ops(p, v, m), p, v)
    rendezvous_replay(interleaved_ops(p, v, m, forward_only=True), p, v)
    rendezvous_replay(interleaved_ops(p, v, m), p, v, tag=lambda t: 0)


def split_steady(ops):
    """1F1B's pairing instead: a steady forward's exchange (its output out, the next gradient in) right after it,
    and the backward's (its input gradient out, the next input in) after the backward."""
    out, i = [], 0
    while i < len(ops):
        if ops[i].kind == "forward" and i + 2 < len(ops) and ops[i + 1].kind == "backward" and isinstance(
                ops[i + 2], Exchange):
            after_f = tuple(t for t in ops[i + 2].transfers if t.kind in ("send_forward", "recv_backward"))
            after_b = tuple(t for t in ops[i + 2].transfers if t.kind in ("send_backward", "recv_forward"))
            out += [ops[i]] + [Exchange(after_f)] * bool(after_f) + [ops[i + 1]] + [Exchange(after_b)] * bool(after_b)
            i += 3
        else:
            out.append(ops[i])
            i += 1
    return out


MEGATRON_POST_ORDER = {"send_backward": 0, "recv_forward": 1, "send_forward": 2, "recv_backward": 3}


def megatron_order(ops):
    """Megatron's batched order: send to prev, recv from prev, send to next, recv from next."""
    return [Exchange(tuple(sorted(op.transfers, key=lambda t: MEGATRON_POST_ORDER[t.kind])))
            if isinstance(op, Exchange) else op for op in ops]


def wrong_wrap_tag(ops, r):
    """Rank 0 tags the inputs of chunk c > 0 by its own chunk, not by rank p-1's chunk c-1 that sends them."""
    if r:
        return ops
    return [Exchange(tuple(Transfer(t.kind, t.mb, t.chunk, t.chunk if t.kind == "recv_forward" else t.boundary)
                           for t in op.transfers)) if isinstance(op, Exchange) else op for op in ops]


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (2, 3, 4), (3, 2, 6)])
def test_replay_catches_mistakes(p, v, m):
    ops = interleaved_ops(p, v, m)
    with pytest.raises(Deadlock):  # neighbours' warm-ups differ by 2, so the two halves meet different batches
        rendezvous_replay([split_steady(o) for o in ops], p, v)
    with pytest.raises(Mismatch):
        rendezvous_replay([wrong_wrap_tag(o, r) for r, o in enumerate(ops)], p, v)
    untagged = [megatron_order(o) for o in ops]
    if p == 2:  # both neighbours are one rank: untagged, an activation is taken for a gradient
        with pytest.raises(Mismatch, match="received by rank"):
            rendezvous_replay(untagged, p, v, tag=lambda t: 0)
    else:
        rendezvous_replay(untagged, p, v, tag=lambda t: 0)
    rendezvous_replay(untagged, p, v)  # tags alone keep the streams apart


def test_one_chunk_ops_unchanged_and_tags():
    for p, r, m in [(4, 1, 4), (2, 0, 3), (1, 0, 2)]:
        steps = one_f_one_b(p, r, m)
        assert with_p2p_ops(steps, r == 0, r == p - 1, num_chunks=1) == with_p2p_ops(steps, r == 0, r == p - 1)
        assert not any(isinstance(op, Exchange) for op in with_p2p_ops(steps, r == 0, r == p - 1))
    # p = 2, v = 2: between ranks 0 and 1 four streams, each its own tag (even: activations, odd: gradients)
    tags = {(r, t.kind, t.chunk): t.tag for r, o in enumerate(interleaved_ops(2, 2, 4)) for op in o
            if isinstance(op, Exchange) for t in op.transfers}
    assert tags[(0, "send_forward", 0)] == tags[(1, "recv_forward", 0)] == 0  # rank 0 c0 -> rank 1 c0
    assert tags[(1, "send_forward", 0)] == tags[(0, "recv_forward", 1)] == 0  # rank 1 c0 -> rank 0 c1 (wrap)
    assert tags[(0, "send_forward", 1)] == tags[(1, "recv_forward", 1)] == 2
    assert tags[(1, "send_backward", 0)] == tags[(0, "recv_backward", 0)] == 1
    assert tags[(0, "send_backward", 1)] == tags[(1, "recv_backward", 0)] == 1  # rank 0 c1 -> rank 1 c0 (wrap)
    assert tags[(1, "send_backward", 1)] == tags[(0, "recv_backward", 1)] == 3
    with pytest.raises(ValueError, match="not one of the 2 model chunks"):
        with_p2p_ops([Step("F", 0, 2)], True, False, num_chunks=2)


# --- Real gloo ranks ---------------------------------------------------------------------------------------------

def layer_weight(k):
    return torch.randn(SHAPE[-1], SHAPE[-1], generator=torch.Generator().manual_seed(k)) / 2


class ChunkChainStage:
    """Rank r of p with v chunks: chunk c is virtual stage k = c·p + r, y = tanh(x W_k); the last virtual stage's
    loss is mean(y^2) / m. A ``ChunkedPipelineStage``."""

    def __init__(self, r, p, v, m):
        self.r, self.p, self.v, self.m = r, p, v, m
        self.weights = [layer_weight(c * p + r).requires_grad_() for c in range(v)]
        self.saved, self.peak, self.losses = {}, 0, []

    def first(self, chunk):
        return self.r == 0 and chunk == 0

    def last(self, chunk):
        return self.r == self.p - 1 and chunk == self.v - 1

    def forward_step(self, mb, chunk, x):
        x = microbatch(mb) if self.first(chunk) else x.requires_grad_()
        refs = self.saved[(mb, chunk)] = []

        def pack(t):
            holder = Saved(t)
            refs.append(weakref.ref(holder))
            return holder

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda h: h.t):
            y = torch.tanh(x @ self.weights[chunk])
            out = (y * y).mean() / self.m if self.last(chunk) else y
        if self.last(chunk):
            self.losses.append(out.detach())
        # Measured: (micro-batch, chunk) pairs whose autograd graph still holds saved activations.
        self.peak = max(self.peak, sum(any(r() is not None for r in rs) for rs in self.saved.values()))
        return out

    def backward_step(self, mb, chunk, x, out, out_grad):
        torch.autograd.backward(out, out_grad)
        return None if self.first(chunk) else x.grad


def run_interleaved(topology, cases):
    p, r = topology.pp_size, topology.pp_rank
    results = []
    for v, m in cases:
        log = []
        comm = P2PCommunicator.for_topology(topology, SHAPE, torch.float32, torch.device("cpu"), log=log,
                                            num_chunks=v)
        stage = ChunkChainStage(r, p, v, m)
        ops = with_p2p_ops(interleaved_one_f_one_b(p, r, m, v), r == 0, r == p - 1, num_chunks=v)
        stats = run_schedule(ops, stage, comm, ScheduleStats(log=log))
        # Dense reference in this process: the whole chain of p·v layers, every micro-batch.
        weights = [layer_weight(k).requires_grad_() for k in range(p * v)]
        ref_loss = 0.0
        for i in range(m):
            y = microbatch(i)
            for w in weights:
                y = torch.tanh(y @ w)
            loss = (y * y).mean() / m
            loss.backward()
            ref_loss += loss.item()
        results.append({
            "log": log, "peak": stage.peak, "stats_peak": stats.peak_in_flight, "p2p_bytes": comm.bytes_sent,
            "loss": sum(x.item() for x in stage.losses) if r == p - 1 else None, "ref_loss": ref_loss,
            "grads": [w.grad.numpy() for w in stage.weights],
            "ref_grads": [weights[c * p + r].grad.numpy() for c in range(v)]})
    return results


@pytest.mark.parametrize("p,cases", [(2, [(2, 4), (3, 4)]), (4, [(2, 8), (2, 4)])], ids=["pp2", "pp4"])
def test_interleaved_order_memory_and_gradients(p, cases):
    """One spawn per world size; (v, m) cases run one after the other on the same ranks. (4, 2, 4) caps the first
    ranks' warm-up at m·v (all forwards first)."""
    results = run_distributed(run_interleaved, world_size=p, pp_size=p, deadline_s=90, cases=cases)
    for i, (v, m) in enumerate(cases):
        for r in range(p):
            res = results[r][i]
            assert res["log"] == expected_interleaved(p, r, m, v), (p, v, m, r)
            bound = min(2 * (p - r - 1) + (v - 1) * p + 1, m * v)
            assert res["peak"] == res["stats_peak"] == bound, (p, v, m, r, res["peak"], res["stats_peak"])
            for c in range(v):
                torch.testing.assert_close(res["grads"][c], res["ref_grads"][c], rtol=1e-6, atol=1e-7,
                                           msg=f"W_{c * p + r} (p={p}, v={v}, m={m})")
            # every (micro-batch, chunk) sends its output on and its input gradient back, but the last virtual
            # stage's output (the loss) and the first's input gradient
            assert res["p2p_bytes"] == (2 * m * v - m * (r == 0) - m * (r == p - 1)) * NBYTES
        assert results[p - 1][i]["loss"] == pytest.approx(results[p - 1][i]["ref_loss"], rel=1e-6, abs=1e-7)
