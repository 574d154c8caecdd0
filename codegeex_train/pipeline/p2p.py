"""Point-to-point between adjacent pipeline stages: activations forward, their gradients backward.

TP rank r of a stage talks to TP rank r of the neighbour stage (same DP rank): ``topology.next_rank`` /
``prev_rank``. Every transfer has the shape (micro-batch, sequence, hidden) in the compute dtype, known
on both sides from the run's plan, so no shapes are exchanged. Each call posts its sends and receives as one
``batch_isend_irecv`` and waits for them: on NCCL the batch is one fused group (two stages sending to
each other at once cannot deadlock), on gloo the ops run as async pairs.

Gloo's sends are rendezvous: a send's data leaves only once the peer has posted the matching receive (the pair
trades "send ready" / "recv ready" notices), so a rank waiting on a send is blocked until the peer reaches that
receive. Gloo matches a send to a receive by (peer, tag), first posted to first posted.

Interleaved 1F1B (``num_chunks`` > 1) runs on the pipeline's ring: rank p-1 sends chunk c's output on to rank 0's
chunk c+1, rank 0 sends chunk c's input gradient back to rank p-1's chunk c-1, so both ends have both neighbours
(``for_topology(..., num_chunks=v)``). Its transfers go through ``exchange``: one ``Transfer`` each, tagged by the
virtual-stage boundary they cross and their direction (``Transfer.tag``), so that with p = 2, where both neighbours
are the same rank, an activation and a gradient travelling between the same two ranks, or two chunks' transfers,
can never be matched with each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # a name for the signature only: the plan lives in config, above this layer
    from codegeex_train.layout.plan import ParallelPlan


@dataclass(frozen=True)
class Transfer:
    """One point-to-point transfer of interleaved 1F1B, named from this rank's side.

    kind   send_forward (this chunk's output, to the next rank), recv_forward (this chunk's input, from the
           previous rank), send_backward (the gradient of this chunk's input, to the previous rank) or
           recv_backward (the gradient of this chunk's output, from the next rank); neighbours on the ring
    mb, chunk  the micro-batch and the model chunk of *this* rank the tensor belongs to
    boundary   the chunk of the upstream side of the virtual-stage boundary crossed (the sender of the activation,
               the receiver of the gradient): both ends of a transfer compute the same one, so
               tag = 2·boundary + (0 forward, 1 backward) is the same at both ends and distinct per stream
    """
    kind: str
    mb: int
    chunk: int
    boundary: int

    @property
    def is_send(self) -> bool:
        return self.kind.startswith("send")

    @property
    def is_forward(self) -> bool:
        return self.kind.endswith("forward")

    @property
    def tag(self) -> int:
        return 2 * self.boundary + (0 if self.is_forward else 1)


class P2PCommunicator:
    """The sends and receives of one pipeline stage; ``log`` (a list) records each one, for tests."""

    def __init__(self, prev_rank: int | None, next_rank: int | None, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device, log: list | None = None, group: dist.ProcessGroup | None = None):
        self.prev_rank, self.next_rank = prev_rank, next_rank  # None on the first / last stage (global ranks)
        self.group = group  # the pipeline group (None: the default group); peers stay global ranks
        self.shape, self.dtype, self.device = shape, dtype, device
        self.log = log
        self.bytes_sent = 0

    @classmethod
    def for_topology(cls, topology, shape, dtype, device, log=None, num_chunks: int = 1) -> "P2PCommunicator":
        """The stage's communicator; with ``num_chunks`` > 1 (interleaved) the first and last stages are each
        other's neighbours (the ring: topology.prev_rank / next_rank wrap)."""
        ring = num_chunks > 1
        return cls(topology.prev_rank if ring or not topology.is_first_stage else None,
                   topology.next_rank if ring or not topology.is_last_stage else None, shape, dtype, device, log,
                   topology.pp_group)

    @classmethod
    def for_plan(cls, topology, plan: ParallelPlan, device, log=None) -> "P2PCommunicator":
        """``for_topology`` with the plan's activation shape and dtype (``plan.p2p_shape``, ``plan.p2p_dtype``: (b, s,
        h), s/tp under sequence parallelism) and its model chunks."""
        return cls.for_topology(topology, plan.p2p_shape, plan.p2p_dtype, device, log, num_chunks=plan.num_chunks)

    def _exchange(self, sends: list[tuple[torch.Tensor, int]], recv_from: int | None) -> torch.Tensor | None:
        ops = [dist.P2POp(dist.isend, t.contiguous(), peer, self.group) for t, peer in sends]
        received = None
        if recv_from is not None:
            received = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, received, recv_from, self.group))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        self.bytes_sent += sum(t.numel() * t.element_size() for t, _ in sends)
        return received

    def exchange(self, transfers: list[tuple[Transfer, torch.Tensor | None]]) -> list[torch.Tensor | None]:
        """Post ``transfers`` (each with its tensor for a send, None for a receive) as one batch, in the order
        given, and wait for all of them; return what each receive got (None for the sends). Activations go to
        ``next_rank`` and come from ``prev_rank``, gradients the other way; each transfer carries its tag."""
        ops, received, sent = [], [], 0
        for transfer, tensor in transfers:
            forward = transfer.is_forward
            if transfer.is_send:
                peer = self.next_rank if forward else self.prev_rank
                ops.append(dist.P2POp(dist.isend, tensor.contiguous(), peer, self.group, transfer.tag))
                sent += tensor.numel() * tensor.element_size()
                received.append(None)
            else:
                peer = self.prev_rank if forward else self.next_rank
                buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
                ops.append(dist.P2POp(dist.irecv, buffer, peer, self.group, transfer.tag))
                received.append(buffer)
            if peer is None:
                raise ValueError(f"{transfer} has no peer: interleaved transfers need the ring "
                                 f"(P2PCommunicator.for_topology(..., num_chunks=v))")
        self._record(*((t.kind, t.mb, t.chunk) for t, _ in transfers))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        self.bytes_sent += sent
        return received

    def _record(self, *events) -> None:
        if self.log is not None:
            self.log.extend(events)

    def recv_forward(self, mb: int) -> torch.Tensor | None:
        if self.prev_rank is None:
            return None
        self._record(("recv_forward", mb))
        return self._exchange([], self.prev_rank)

    def send_forward(self, output: torch.Tensor, mb: int) -> None:
        if self.next_rank is not None:
            self._record(("send_forward", mb))
            self._exchange([(output, self.next_rank)], None)

    def recv_backward(self, mb: int) -> torch.Tensor | None:
        if self.next_rank is None:
            return None
        self._record(("recv_backward", mb))
        return self._exchange([], self.next_rank)

    def send_backward(self, input_grad: torch.Tensor | None, mb: int) -> None:
        if self.prev_rank is not None:
            self._record(("send_backward", mb))
            self._exchange([(input_grad, self.prev_rank)], None)

    def send_forward_recv_backward(self, output: torch.Tensor, mb_sent: int, mb_recv: int) -> torch.Tensor | None:
        """Steady state after a forward: the output goes down, the gradient of an older one comes up."""
        if self.next_rank is None:
            return None
        self._record(("send_forward", mb_sent), ("recv_backward", mb_recv))
        return self._exchange([(output, self.next_rank)], self.next_rank)

    def send_backward_recv_forward(self, input_grad: torch.Tensor | None, mb_sent: int,
                                   mb_recv: int) -> torch.Tensor | None:
        """Steady state after a backward: the input gradient goes up, the next input comes down."""
        if self.prev_rank is None:
            return None
        self._record(("send_backward", mb_sent), ("recv_forward", mb_recv))
        return self._exchange([(input_grad, self.prev_rank)], self.prev_rank)
