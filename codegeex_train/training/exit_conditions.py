"""Stopping early and cleanly: preemption (SIGTERM) and wall-clock limits, Megatron's ``--exit-signal-handler``
and ``--exit-duration-in-mins``.

SLURM and Kubernetes send SIGTERM some seconds before they kill a job, possibly to only some of its processes.
The handler just records the signal; at the end of every iteration all ranks combine their flags with one
all-reduce (MAX) of two integers over the world, so every rank decides to stop at the same iteration, saves
its part of the same checkpoint, and exits 0. Deciding per rank would leave the ranks that did not see the
signal waiting forever in the next iteration's collectives.
"""

from __future__ import annotations

import signal
import time

import torch
import torch.distributed as dist


class ExitConditions:
    def __init__(self, *, signal_handler: bool, duration_mins: float | None, start_time: float,
                 device: torch.device, sig: int = signal.SIGTERM) -> None:
        self.duration_mins = duration_mins
        self.start_time = start_time
        self.device = device
        self.signal_name = signal.Signals(sig).name
        self.received = False
        self._previous = None
        self._sig = sig
        if signal_handler:
            self._previous = signal.signal(sig, self._on_signal)
        self.active = signal_handler or duration_mins is not None

    def _on_signal(self, signum, frame) -> None:  # runs between bytecodes in the main thread: only a flag
        self.received = True

    def check(self) -> str | None:
        """Collective over the world (every rank, every iteration, when active): why to stop, or None."""
        if not self.active:
            return None
        timed_out = self.duration_mins is not None and (time.time() - self.start_time) / 60 >= self.duration_mins
        flags = torch.tensor([int(self.received), int(timed_out)], dtype=torch.int32, device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[0]:
            return f"{self.signal_name} received (--exit-signal-handler)"
        if flags[1]:
            return f"--exit-duration-in-mins {self.duration_mins:g} reached"
        return None

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(self._sig, self._previous)
            self._previous = None
