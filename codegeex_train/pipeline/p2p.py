"""Point-to-point between adjacent pipeline stages: activations forward, their gradients backward.

TP rank r of a stage talks to TP rank r of the neighbour stage (same DP rank): ``topology.next_rank`` /
``prev_rank``. Every transfer has the shape (micro-batch, sequence, hidden) in the compute dtype, known
on both sides from the flags, so no shapes are exchanged. Each call posts its sends and receives as one
``batch_isend_irecv`` and waits for them: on NCCL the batch is one fused group (two stages sending to
each other at once cannot deadlock), on gloo the ops run as async pairs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


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
    def for_topology(cls, topology, shape, dtype, device, log=None) -> "P2PCommunicator":
        return cls(None if topology.is_first_stage else topology.prev_rank,
                   None if topology.is_last_stage else topology.next_rank, shape, dtype, device, log,
                   topology.pp_group)

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
