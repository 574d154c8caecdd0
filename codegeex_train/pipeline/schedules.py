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
It refuses interleaved steps (chunk > 0) for now: their transfers also wrap from rank p-1 to rank 0 between
chunks. ``simulate.py`` replays all ranks' schedules against the data dependencies (deadlock, bubble).

The executor's contract with a stage (``PipelineStage``):
    forward_step(mb, input_tensor) -> output     input_tensor: None on the first stage (it reads its own
                                                 ids); output: hidden states, or the loss on the last stage
    backward_step(mb, input_tensor, output, output_grad) -> input_grad
                                                 output_grad: None on the last stage (the loss starts it);
                                                 input_grad: None on the first stage
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from codegeex_train.pipeline.p2p import P2PCommunicator


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


def with_p2p_ops(steps: list[Step], is_first: bool, is_last: bool) -> list[Op]:
    """The ops of a stage: each step with the receives it needs before and the sends it owes after."""
    if any(step.chunk for step in steps):
        raise ValueError("with_p2p_ops pairs the transfers of one model chunk; interleaved steps (chunk > 0) "
                         "need chunk-aware pairing")
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


class PipelineStage(Protocol):
    def forward_step(self, mb: int, input_tensor: torch.Tensor | None) -> torch.Tensor: ...

    def backward_step(self, mb: int, input_tensor: torch.Tensor | None, output: torch.Tensor,
                      output_grad: torch.Tensor | None) -> torch.Tensor | None: ...


@dataclass
class ScheduleStats:
    peak_in_flight: int = 0  # most micro-batches whose activations this stage held at once
    log: list = field(default_factory=list)  # ("forward", mb) / ("backward", mb), in execution order


def run_schedule(ops: list[Op], stage: PipelineStage, comm: P2PCommunicator,
                 stats: ScheduleStats | None = None) -> ScheduleStats:
    """Execute ``ops``. Activations (input, output) live from a micro-batch's forward to its backward;
    forward-only ops (no backward) drops them at once."""
    stats = stats or ScheduleStats()
    has_backward = any(op.kind == "backward" for op in ops)
    inputs: dict[int, torch.Tensor | None] = {}
    outputs: dict[int, torch.Tensor] = {}
    output_grads: dict[int, torch.Tensor | None] = {}
    input_grad = None
    for op in ops:
        if op.kind == "recv_forward":
            inputs[op.mb] = comm.recv_forward(op.mb)
        elif op.kind == "forward":
            stats.log.append(("forward", op.mb))
            output = stage.forward_step(op.mb, inputs.get(op.mb))
            if has_backward:
                outputs[op.mb] = output
                stats.peak_in_flight = max(stats.peak_in_flight, len(outputs))
            else:
                inputs.pop(op.mb, None)
        elif op.kind == "send_forward":
            comm.send_forward(output, op.mb)
        elif op.kind == "send_forward_recv_backward":
            output_grads[op.recv_mb] = comm.send_forward_recv_backward(output, op.mb, op.recv_mb)
        elif op.kind == "recv_backward":
            output_grads[op.mb] = comm.recv_backward(op.mb)
        elif op.kind == "backward":
            stats.log.append(("backward", op.mb))
            input_grad = stage.backward_step(op.mb, inputs.pop(op.mb, None), outputs.pop(op.mb),
                                             output_grads.pop(op.mb, None))
        elif op.kind == "send_backward":
            comm.send_backward(input_grad, op.mb)
        elif op.kind == "send_backward_recv_forward":
            inputs[op.recv_mb] = comm.send_backward_recv_forward(input_grad, op.mb, op.recv_mb)
        else:
            raise ValueError(f"unknown pipeline op {op.kind!r}")
    if outputs or output_grads:
        raise RuntimeError(f"schedule left micro-batches {sorted(outputs)} without a backward")
    return stats
