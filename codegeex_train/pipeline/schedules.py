"""Pipeline schedules as pure functions, and the executor that runs one on a stage.

A schedule is this stage's order of forward (F) and backward (B) micro-batch steps:

    1F1B, stage s of p, m micro-batches (Megatron's PipeDream-flush):
      warm-up    F(0) .. F(w-1)                      w = min(p - s - 1, m) forwards
      steady     F(w) B(0)  F(w+1) B(1) ...          one forward, one backward, m - w times
      cool-down  B(m-w) .. B(m-1)                    the backwards still owed
    no pipelining (p = 1): F(0) B(0) F(1) B(1) ...   plain gradient accumulation (1F1B with w = 0)

    interleaved 1F1B, rank r of p, v model chunks per rank (chunk c = virtual stage c·p + r), m micro-batches,
    m divisible by p (Megatron's interleaved schedule; ``interleaved_one_f_one_b``):
      virtual step k -> micro-batch (k // (p·v))·p + k % p, chunk (k // p) % v (backwards: v - 1 - that chunk)
      warm-up    w = min(2·(p - r - 1) + (v - 1)·p, m·v) forwards
      steady     F(w + i) B(i) over (micro-batch, chunk) pairs, m·v - w times; cool-down the backwards owed
      bubble     (p - 1)/(v·m) of the ideal time instead of (p - 1)/m; rank r holds at most min(w + 1, m·v)
                 chunk activations (v = 1 is exactly 1F1B)

``with_p2p_ops`` turns a one-chunk schedule into the ops the stage runs, pairing a send with the receive that
follows it (send-forward + receive-backward after a steady forward, send-backward + receive-forward after a steady
backward), as Megatron does. Stage s then holds at most w + 1 = p - s micro-batches of activations in 1F1B.
``simulate.py`` replays all ranks' schedules against the data dependencies (deadlock, bubble).

With ``num_chunks`` = v > 1 it pairs interleaved steps as Megatron's interleaved loop does, on the ring (rank p-1's
chunk c feeds rank 0's chunk c+1; rank 0's chunk c sends its input gradient to rank p-1's chunk c-1; the first
virtual stage, rank 0 chunk 0, reads its own input; the last, rank p-1 chunk v-1, computes the loss). The steps
are cut into slots: a warm-up forward, a steady (forward, backward) pair, a cool-down backward. Before the first
slot and after every slot comes one ``Exchange``, a single blocking batch holding

    the sends the slot owes      its forward's output, its backward's input gradient
    the receives the next needs  its forward's input, its backward's output gradient

posted in the order send_forward, recv_forward, send_backward, recv_backward (Megatron's send_forward_recv_forward
in the warm-up, the 4-way send_forward_backward_recv_forward_backward in the steady state, send_backward_recv_backward
in the cool-down). Numbering rank r's exchanges j = 0, 1, ...: exchange j sends F_{j-1}'s output and B_{j-1-w}'s
gradient and receives F_j's input and B_{j-w}'s gradient (F_i, B_i: the rank's i-th forward, backward; w its warm-up).
The slots are read off the steps: a rank whose forwards all come first is all warm-up (w = m·v: the last forward's
exchange also receives B_0's gradient), also where the formula gives w = m·v - 1, whose steps are the same (there
Megatron runs F_{m·v-1}, B_0 as one steady pair; both pairings are deadlock-free, replayed in the tests).

Why it cannot deadlock. Gloo sends are rendezvous (a send completes only once the peer posted its receive), so
what matters is which batches are posted together. All ranks run the forwards in the same (micro-batch, chunk)
order, and F_i's input on rank r + 1 is F_i's output on rank r (on the wrap, rank p-1's F_i feeds rank 0's
F_{i+p}); the backwards mirror it. So the output rank r sends in exchange j is received by rank r+1 in its exchange
j-1, and, as the warm-ups differ by exactly 2 between neighbours, the gradient rank r+1 sends in its exchange j' is
received by rank r in its exchange j'+1. Giving rank r's exchange j the round j + r, every transfer's two ends are
in the same round (on the wrap too: rank 0's exchange j meets rank p-1's exchange j - (p-1)), and each rank's rounds
increase; so round by round every batch of the round finds all its peers' batches posted and completes (induction
on the round). Where the warm-up is capped at m·v (few micro-batches, e.g. p = 4, v = 2, m = 4) the rounds no
longer line up exactly; tests/pipeline/test_executor_interleaved.py replays every rank's ops under rendezvous
semantics for those cases too, and runs them on real gloo ranks.

p = 2: both neighbours are the same rank, so in one exchange rank 0 may send an activation and a gradient to rank 1
and receive both from it. Gloo matches by (peer, tag), first posted first matched; each ``Transfer`` is tagged
2·boundary + direction (the upstream chunk of the virtual-stage boundary it crosses, both ends agreeing), so each
tag is one stream, sent and received in the same (micro-batch) order at both ends, and an activation cannot be
taken for a gradient. The fixed posting order (forward before backward, at both ends) keeps the matching right
even for a backend that ignores tags (NCCL; replayed untagged in the tests). Megatron's parallel_state refuses
interleaving with p <= 2; its batch order (send to prev, receive from prev, send to next, receive from next),
untagged, takes a gradient for an activation there (the tests' replay shows it).

v = 1 keeps today's 1F1B ops exactly.

The executor's contract with a stage (``PipelineStage``):
    forward_step(mb, input_tensor) -> output     input_tensor: None on the first stage (it reads its own
                                                 ids); output: hidden states, or the loss on the last stage
    backward_step(mb, input_tensor, output, output_grad) -> input_grad
                                                 output_grad: None on the last stage (the loss starts it);
                                                 input_grad: None on the first stage
and, for interleaved ops, with the chunk after the micro-batch (``ChunkedPipelineStage``): forward_step(mb, chunk,
input_tensor), backward_step(mb, chunk, input_tensor, output, output_grad); "first" and "last" then mean the first
and last virtual stage (rank 0 chunk 0, rank p-1 chunk v-1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from codegeex_train.pipeline.p2p import P2PCommunicator, Transfer


@dataclass(frozen=True)
class Step:
    kind: str  # "F" or "B"
    mb: int
    chunk: int = 0  # the model chunk (virtual stage) of this rank it runs; 0 without interleaving


def one_f_one_b(pp_size: int, pp_rank: int, num_microbatches: int) -> list[Step]:
    warmup = min(pp_size - pp_rank - 1, num_microbatches)
    steps = [Step("F", i) for i in range(warmup)]
    for k in range(num_microbatches - warmup):
        steps += [Step("F", warmup + k), Step("B", k)]
    return steps + [Step("B", k) for k in range(num_microbatches - warmup, num_microbatches)]


def interleaved_one_f_one_b(pp_size: int, pp_rank: int, num_microbatches: int, num_chunks: int) -> list[Step]:
    """Megatron's interleaved 1F1B for rank ``pp_rank`` of ``pp_size`` holding ``num_chunks`` model chunks.

    With p = pp_size, r = pp_rank, m = num_microbatches, v = num_chunks: rank r holds chunks c = 0 .. v-1, chunk c
    being virtual stage c·p + r of the p·v (so the activations go rank 0 .. p-1 in chunk 0, back to rank 0 for
    chunk 1, ...). The rank runs m·v forward and m·v backward steps, numbered k = 0 .. m·v - 1 each, taking
    micro-batches in groups of p through every chunk before the next group:

        forward k   -> Step("F", mb=(k // (p·v))·p + k % p, chunk=(k // p) % v)
        backward k  -> Step("B", the same mb,                chunk=v - 1 - (k // p) % v)
        warm-up     w = min(2·(p - r - 1) + (v - 1)·p, m·v) forwards: forward 0 .. w-1
        steady      forward w + i, backward i, for i = 0 .. m·v - w - 1
        cool-down   backward m·v - w .. m·v - 1

    (When the warm-up formula reaches m·v the rank runs every forward, then every backward; current Megatron's
    rule, which for m = p makes the first ranks all-warm-up and lets the last ones 1F1B.) With a forward of a
    chunk taking t_f/v and its backward t_b/v, the bubble is (p - 1)·(t_f + t_b)/v, i.e. (p - 1)/(v·m) of the
    ideal time m·(t_f + t_b) instead of 1F1B's (p - 1)/m; the price is v times the point-to-point transfers and
    more activations in flight: at most min(w + 1, m·v) (micro-batch, chunk) pairs, each 1/v of a stage's
    layers (rank 0: (v·p + p - 1)/v stage-equivalents against 1F1B's p).

    ``num_chunks = 1`` is exactly ``one_f_one_b`` (whose warm-up is p - r - 1). Interleaving (v > 1) needs
    pp_size > 1 and m divisible by p (Megatron's rule: every group of p micro-batches fills the pipeline).
    """
    if num_chunks < 1:
        raise ValueError(f"interleaved 1F1B: num_chunks must be at least 1, got {num_chunks}")
    if pp_size < 1 or not 0 <= pp_rank < pp_size:
        raise ValueError(f"interleaved 1F1B: pipeline rank {pp_rank} is not in 0..{pp_size - 1}")
    if num_microbatches < 1:
        raise ValueError(f"interleaved 1F1B: num_microbatches must be at least 1, got {num_microbatches}")
    if num_chunks == 1:
        return one_f_one_b(pp_size, pp_rank, num_microbatches)
    if pp_size == 1:
        raise ValueError(f"interleaved 1F1B: {num_chunks} model chunks per rank need a pipeline (pp_size > 1)")
    if num_microbatches % pp_size:
        raise ValueError(f"interleaved 1F1B: the number of micro-batches ({num_microbatches}) must be divisible "
                         f"by the pipeline size ({pp_size})")
    p, v, total = pp_size, num_chunks, num_microbatches * num_chunks

    def virtual(kind: str, k: int) -> Step:
        chunk = (k // p) % v
        return Step(kind, (k // (p * v)) * p + k % p, chunk if kind == "F" else v - 1 - chunk)

    warmup = min(2 * (p - pp_rank - 1) + (v - 1) * p, total)
    steps = [virtual("F", k) for k in range(warmup)]
    for i in range(total - warmup):
        steps += [virtual("F", warmup + i), virtual("B", i)]
    return steps + [virtual("B", k) for k in range(total - warmup, total)]


def no_pipelining(num_microbatches: int) -> list[Step]:
    return one_f_one_b(1, 0, num_microbatches)


def forward_only(num_microbatches: int) -> list[Step]:
    return [Step("F", i) for i in range(num_microbatches)]


@dataclass(frozen=True)
class Op:
    kind: str  # forward, backward, recv_forward, send_forward, recv_backward, send_backward,
    #            send_forward_recv_backward, send_backward_recv_forward
    mb: int
    recv_mb: int | None = None  # the micro-batch received by a combined op
    chunk: int = 0  # forward / backward of interleaved ops: the model chunk


@dataclass(frozen=True)
class Exchange:
    """Interleaved ops: ``transfers`` posted as one batch (``P2PCommunicator.exchange``) and waited for."""
    transfers: tuple[Transfer, ...]
    kind = "exchange"


def with_p2p_ops(steps: list[Step], is_first: bool, is_last: bool, num_chunks: int = 1) -> list[Op | Exchange]:
    """The ops of a stage: each step with the receives it needs before and the sends it owes after.

    ``num_chunks`` > 1: the interleaved pairing (module docstring), ``is_first`` / ``is_last`` being this rank's
    place in the pipeline (pipeline rank 0 / p-1, not the virtual stage)."""
    if num_chunks > 1:
        return _interleaved_p2p_ops(steps, is_first, is_last, num_chunks)
    if any(step.chunk for step in steps):
        raise ValueError("with_p2p_ops: interleaved steps (chunk > 0) need chunk-aware pairing: pass num_chunks")
    ops: list[Op] = []
    received: set[tuple[str, int]] = set()
    for i, step in enumerate(steps):
        nxt = steps[i + 1] if i + 1 < len(steps) else None
        if step.kind == "F":
            if not is_first and ("F", step.mb) not in received:
                ops.append(Op("recv_forward", step.mb))
            ops.append(Op("forward", step.mb))
            if not is_last:
                if nxt is not None and nxt.kind == "B":
                    ops.append(Op("send_forward_recv_backward", step.mb, nxt.mb))
                    received.add(("B", nxt.mb))
                else:
                    ops.append(Op("send_forward", step.mb))
        else:
            if not is_last and ("B", step.mb) not in received:
                ops.append(Op("recv_backward", step.mb))
            ops.append(Op("backward", step.mb))
            if not is_first:
                if nxt is not None and nxt.kind == "F":
                    ops.append(Op("send_backward_recv_forward", step.mb, nxt.mb))
                    received.add(("F", nxt.mb))
                else:
                    ops.append(Op("send_backward", step.mb))
    return ops


_EXCHANGE_ORDER = {"send_forward": 0, "recv_forward": 1, "send_backward": 2, "recv_backward": 3}


def _interleaved_p2p_ops(steps: list[Step], is_first: bool, is_last: bool, num_chunks: int) -> list[Op | Exchange]:
    v = num_chunks
    for step in steps:
        if not 0 <= step.chunk < v:
            raise ValueError(f"with_p2p_ops: {step} is not one of the {v} model chunks")
    # Slots: the warm-up forwards one by one, the steady (forward, backward) pairs, the cool-down backwards one by
    # one. The warm-up is the leading forwards but the first steady one; when every forward leads, the rank is all
    # warm-up: its last forward's exchange receives the first backward's gradient. (Pairing that forward with the
    # first backward instead would receive B_0's gradient before computing the forward the next rank needs first:
    # a deadlock wherever the warm-up is capped at m·v.)
    leading = next((i for i, s in enumerate(steps) if s.kind != "F"), len(steps))
    warmup = leading if leading == sum(s.kind == "F" for s in steps) else leading - 1
    slots: list[list[Step]] = []
    i = 0
    while i < len(steps):
        size = 2 if i >= warmup and steps[i].kind == "F" and i + 1 < len(steps) and steps[i + 1].kind == "B" else 1
        slots.append(steps[i:i + size])
        i += size

    def first_virtual(step: Step) -> bool:
        return is_first and step.chunk == 0

    def last_virtual(step: Step) -> bool:
        return is_last and step.chunk == v - 1

    def sends(slot: list[Step]) -> list[Transfer]:
        # a forward's output crosses the boundary above its own chunk; an input gradient the one below it, whose
        # upstream chunk is this chunk - 1 on rank 0 (it goes round to rank p-1), this chunk elsewhere
        out = []
        for s in slot:
            if s.kind == "F" and not last_virtual(s):
                out.append(Transfer("send_forward", s.mb, s.chunk, s.chunk))
            elif s.kind == "B" and not first_virtual(s):
                out.append(Transfer("send_backward", s.mb, s.chunk, s.chunk - 1 if is_first else s.chunk))
        return out

    def receives(slot: list[Step]) -> list[Transfer]:
        out = []
        for s in slot:
            if s.kind == "F" and not first_virtual(s):
                out.append(Transfer("recv_forward", s.mb, s.chunk, s.chunk - 1 if is_first else s.chunk))
            elif s.kind == "B" and not last_virtual(s):
                out.append(Transfer("recv_backward", s.mb, s.chunk, s.chunk))
        return out

    ops: list[Op | Exchange] = []
    for t in range(len(slots) + 1):
        transfers = (sends(slots[t - 1]) if t > 0 else []) + (receives(slots[t]) if t < len(slots) else [])
        if transfers:
            ops.append(Exchange(tuple(sorted(transfers, key=lambda x: _EXCHANGE_ORDER[x.kind]))))
        if t < len(slots):
            ops += [Op("forward" if s.kind == "F" else "backward", s.mb, chunk=s.chunk) for s in slots[t]]
    return ops


class PipelineStage(Protocol):
    def forward_step(self, mb: int, input_tensor: torch.Tensor | None) -> torch.Tensor: ...

    def backward_step(self, mb: int, input_tensor: torch.Tensor | None, output: torch.Tensor,
                      output_grad: torch.Tensor | None) -> torch.Tensor | None: ...


class ChunkedPipelineStage(Protocol):
    """A rank holding several model chunks (interleaved 1F1B): the chunk follows the micro-batch."""

    def forward_step(self, mb: int, chunk: int, input_tensor: torch.Tensor | None) -> torch.Tensor: ...

    def backward_step(self, mb: int, chunk: int, input_tensor: torch.Tensor | None, output: torch.Tensor,
                      output_grad: torch.Tensor | None) -> torch.Tensor | None: ...


class _OneChunk:
    """A ``PipelineStage`` seen as a ``ChunkedPipelineStage`` with the single chunk 0."""

    def __init__(self, stage: PipelineStage):
        self.stage = stage

    def forward_step(self, mb, chunk, input_tensor):
        assert chunk == 0, chunk
        return self.stage.forward_step(mb, input_tensor)

    def backward_step(self, mb, chunk, input_tensor, output, output_grad):
        assert chunk == 0, chunk
        return self.stage.backward_step(mb, input_tensor, output, output_grad)


@dataclass
class ScheduleStats:
    peak_in_flight: int = 0  # most (micro-batch, chunk) activations this stage held at once
    log: list = field(default_factory=list)  # ("forward", mb) / ("backward", mb), in execution order; interleaved
    #                                          ops: ("forward", mb, chunk) / ("backward", mb, chunk)


def run_schedule(ops: list[Op | Exchange], stage: PipelineStage | ChunkedPipelineStage, comm: P2PCommunicator,
                 stats: ScheduleStats | None = None, chunked: bool | None = None) -> ScheduleStats:
    """Execute ``ops``. Activations (input, output) live from a (micro-batch, chunk)'s forward to its backward;
    forward-only ops (no backward) drop them once the output is sent. ``chunked``: call the stage with the chunk
    (``ChunkedPipelineStage``); by default when the ops are interleaved (``with_p2p_ops(..., num_chunks > 1)``)."""
    stats = stats or ScheduleStats()
    if chunked is None:
        chunked = any(isinstance(op, Exchange) or op.chunk for op in ops)
    run = stage if chunked else _OneChunk(stage)
    has_backward = any(op.kind == "backward" for op in ops)
    Key = tuple[int, int]  # (micro-batch, chunk)
    inputs: dict[Key, torch.Tensor | None] = {}
    outputs: dict[Key, torch.Tensor] = {}  # awaiting their backward
    unsent: dict[Key, torch.Tensor] = {}  # forward-only: awaiting their send
    output_grads: dict[Key, torch.Tensor | None] = {}
    input_grads: dict[Key, torch.Tensor | None] = {}  # awaiting their send
    output = input_grad = None
    for op in ops:
        if isinstance(op, Exchange):
            outgoing = []
            for t in op.transfers:
                key = (t.mb, t.chunk)
                if t.kind == "send_forward":
                    outgoing.append((t, outputs[key] if key in outputs else unsent.pop(key)))
                elif t.kind == "send_backward":
                    outgoing.append((t, input_grads.pop(key)))
                else:
                    outgoing.append((t, None))
            for (t, _), received in zip(outgoing, comm.exchange(outgoing)):
                if t.kind == "recv_forward":
                    inputs[(t.mb, t.chunk)] = received
                elif t.kind == "recv_backward":
                    output_grads[(t.mb, t.chunk)] = received
            continue
        key = (op.mb, op.chunk)
        if op.kind == "recv_forward":
            inputs[key] = comm.recv_forward(op.mb)
        elif op.kind == "forward":
            stats.log.append(("forward", *key) if chunked else ("forward", op.mb))
            output = run.forward_step(op.mb, op.chunk, inputs.get(key))
            if has_backward:
                outputs[key] = output
                stats.peak_in_flight = max(stats.peak_in_flight, len(outputs))
            else:
                inputs.pop(key, None)
                if chunked:
                    unsent[key] = output
        elif op.kind == "send_forward":
            comm.send_forward(output, op.mb)
        elif op.kind == "send_forward_recv_backward":
            output_grads[(op.recv_mb, 0)] = comm.send_forward_recv_backward(output, op.mb, op.recv_mb)
        elif op.kind == "recv_backward":
            output_grads[key] = comm.recv_backward(op.mb)
        elif op.kind == "backward":
            stats.log.append(("backward", *key) if chunked else ("backward", op.mb))
            input_grad = run.backward_step(op.mb, op.chunk, inputs.pop(key, None), outputs.pop(key),
                                           output_grads.pop(key, None))
            if chunked:
                input_grads[key] = input_grad
        elif op.kind == "send_backward":
            comm.send_backward(input_grad, op.mb)
        elif op.kind == "send_backward_recv_forward":
            inputs[(op.recv_mb, 0)] = comm.send_backward_recv_forward(input_grad, op.mb, op.recv_mb)
        else:
            raise ValueError(f"unknown pipeline op {op.kind!r}")
    if outputs or output_grads:
        raise RuntimeError(f"schedule left (micro-batch, chunk) pairs {sorted(outputs)} without a backward")
    return stats
