"""Stopping early: cleanly on preemption (SIGTERM) and wall-clock limits, Megatron's ``--exit-signal-handler``
and ``--exit-duration-in-mins``; with an error on bad numbers (``NumericalHealth``).

SLURM and Kubernetes send SIGTERM some seconds before they kill a job, possibly to only some of its processes.
The handler just records the signal; at the end of every iteration all ranks combine their flags with one
all-reduce (MAX) of a few integers over the world, so every rank decides to stop at the same iteration, saves
its part of the same checkpoint, and exits 0. Deciding per rank would leave the ranks that did not see the
signal waiting forever in the next iteration's collectives.

After a stop by signal, rank 0 writes ``<save>/preempted`` holding the tag it saved, after ``latest`` (the
checkpoint manager does, ``checkpoint/manager.py``): the launchers report such a job as failed (DeepSpeed's per-node
launcher exits 1 once it has been signalled, torchrun raises), so a wrapper reads the marker instead. The marker
names the current ``latest`` only when this run stopped there by a signal: a run removes it when it starts training,
and a launching script should remove it before the launch (a run that dies before training starts cannot).
docs/clusters-preemption.md has the recipes.

The numerical health flags ride in the same all-reduce: the loss lives only on the last pipeline stage's ranks
(and differs between DP ranks), so a NaN seen there must stop the first stage's ranks too, at the same
iteration, before anyone saves.
"""

from __future__ import annotations

import math
import signal
import time

import torch
import torch.distributed as dist

# A first-bad iteration i travels as _FAR - i, so MAX over ranks picks the earliest one (0: none).
_FAR = 2 ** 62


class NumericalHealthError(SystemExit):
    """The run's numbers went bad. Raised on every rank at the same iteration (the decision is collective),
    exit status 1; ``str()`` is the one-line message, which rank 0 prints once as ``error: ...``."""

    def __init__(self, message: str) -> None:
        super().__init__(1)
        self.message = message

    def __str__(self) -> str:
        return self.message


class NumericalHealth:
    """Watches every iteration's loss, gradient norm and DeepSpeed's skipped steps without a host sync; the
    verdict is reached by ``ExitConditions.check``'s all-reduce and left in ``problem``.

    - loss (this rank's mean over its micro-batches; zero off the last stage) NaN or Inf: an error;
    - gradient norm (``engine.get_global_grad_norm()``, global over the world) NaN, Inf or DeepSpeed's
      invalid sentinel (< 0): an error in fp32/bf16; with fp16 it is an overflow, which DeepSpeed answers by
      skipping the step and halving the loss scale, so it is counted instead (``skipped_iterations``);
    - more than ``max_consecutive_skipped`` skipped steps in a row (0: no limit): an error.

    ``every_iteration`` checks at every iteration; otherwise the trainer checks only at iterations that log or
    save (the flags accumulate on the device in between, so the first bad iteration is still named and no
    checkpoint is ever written without a check).
    """

    def __init__(self, *, every_iteration: bool, check_grad_norm: bool, max_consecutive_skipped: int,
                 skipped_steps: int, device: torch.device) -> None:
        self.every_iteration = every_iteration
        self.check_grad_norm = check_grad_norm
        self.max_consecutive_skipped = max_consecutive_skipped
        self.device = device
        self._first_bad = torch.zeros(2, dtype=torch.int64, device=device)  # [loss, grad norm]; 0: none yet
        self._skipped_total = skipped_steps  # DeepSpeed's counter (restored with a checkpoint)
        self.skipped_in_interval = 0
        self.consecutive_skipped = 0
        self.problem: str | None = None  # set by ExitConditions.check: the world's verdict

    def observe(self, iteration: int, loss: torch.Tensor, grad_norm, skipped_steps: int) -> None:
        """Record one finished optimizer step (device ops only: no host sync)."""
        bad = torch.stack([~torch.isfinite(loss.detach().float()).reshape(()), self._bad_grad_norm(grad_norm)])
        self._first_bad = torch.where(bad & (self._first_bad == 0), iteration, self._first_bad)
        skipped = skipped_steps - self._skipped_total  # a Python int: DeepSpeed's overflow decision is global
        self._skipped_total = skipped_steps
        self.skipped_in_interval += skipped
        self.consecutive_skipped = self.consecutive_skipped + 1 if skipped else 0

    def _bad_grad_norm(self, grad_norm) -> torch.Tensor:
        if not self.check_grad_norm or grad_norm is None:
            return torch.zeros((), dtype=torch.bool, device=self.device)
        if not torch.is_tensor(grad_norm):  # a float (DeepSpeed's inf after an overflow): no host-to-device copy
            bad = not math.isfinite(grad_norm) or grad_norm < 0
            return torch.full((), bad, dtype=torch.bool, device=self.device)
        norm = grad_norm.detach().to(self.device, torch.float32, non_blocking=True).reshape(())
        return ~torch.isfinite(norm) | (norm < 0)  # DeepSpeed reports an invalid norm as -1 in places

    @property
    def too_many_skipped(self) -> bool:
        return 0 < self.max_consecutive_skipped < self.consecutive_skipped

    def take_skipped_in_interval(self) -> int:
        """Skipped steps since the last call (one log interval), for the ``skipped_iterations`` metric."""
        count, self.skipped_in_interval = self.skipped_in_interval, 0
        return count

    def local_flags(self) -> torch.Tensor:
        """int64 [earliest bad-loss iteration, earliest bad-grad-norm iteration, consecutive skips], encoded for
        an all-reduce MAX."""
        first = torch.where(self._first_bad > 0, _FAR - self._first_bad, torch.zeros_like(self._first_bad))
        return torch.cat([first, torch.full((1,), self.consecutive_skipped, dtype=torch.int64, device=self.device)])

    def judge(self, reduced: list[int]) -> str | None:
        """The world's verdict from the reduced ``local_flags``: what went wrong, or None."""
        bad_loss, bad_grad, consecutive = (_FAR - reduced[0] if reduced[0] else 0,
                                           _FAR - reduced[1] if reduced[1] else 0, reduced[2])
        if bad_loss or bad_grad:
            what = ("the loss and the gradient norm are" if bad_loss == bad_grad else
                    "the loss is" if bad_loss and (not bad_grad or bad_loss < bad_grad) else "the gradient norm is")
            first = min(i for i in (bad_loss, bad_grad) if i)
            return f"{what} NaN or Inf at iteration {first}"
        if 0 < self.max_consecutive_skipped < consecutive:
            return (f"{consecutive} consecutive iterations were skipped by fp16 dynamic loss scaling (the gradients "
                    f"overflow at every loss scale), more than --max-consecutive-skipped-iterations "
                    f"{self.max_consecutive_skipped}")
        return None


class ExitConditions:
    def __init__(self, *, signal_handler: bool, duration_mins: float | None, start_time: float,
                 device: torch.device, sig: int = signal.SIGTERM) -> None:
        self.duration_mins = duration_mins
        self.start_time = start_time
        self.device = device
        self.signal_name = signal.Signals(sig).name
        self.received = False  # this rank got the signal
        self.stopped_by_signal = False  # the world's verdict: some rank got it (set by check)
        self._previous = None
        self._sig = sig
        if signal_handler:
            self._previous = signal.signal(sig, self._on_signal)
        self.active = signal_handler or duration_mins is not None

    def _on_signal(self, signum, frame) -> None:  # runs between bytecodes in the main thread: only a flag
        self.received = True

    def check(self, health: NumericalHealth | None = None, *, due: bool = False) -> str | None:
        """Collective over the world: why to stop cleanly, or None; also sets ``health.problem``.

        Runs (on every rank alike) when active (every iteration), when ``health`` checks every iteration, or
        when ``due`` (an iteration that logs or saves); otherwise returns None at no cost. One all-reduce of
        at most five integers and one host sync."""
        checks_health = health is not None and (health.every_iteration or due)
        if not (self.active or checks_health):
            return None
        timed_out = self.duration_mins is not None and (time.time() - self.start_time) / 60 >= self.duration_mins
        flags = torch.tensor([int(self.received), int(timed_out)], dtype=torch.int64, device=self.device)
        if checks_health:
            flags = torch.cat([flags, health.local_flags()])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        values = flags.tolist()  # the one host sync
        if checks_health:
            health.problem = health.judge(values[2:])
        if values[0]:
            self.stopped_by_signal = True
            return f"{self.signal_name} received (--exit-signal-handler)"
        if values[1]:
            return f"--exit-duration-in-mins {self.duration_mins:g} reached"
        return None

    def close(self) -> None:
        """Restore the previous handler; after a stop by signal, ignore the signal instead. The rank is on its way
        out, and another SIGTERM (DeepSpeed's launcher terminates its ranks one after the other, so the second
        one's arrives once the first has exited; a repeated scancel) must not kill it between its save and its exit
        0. SIG_IGN, not our handler: the interpreter resets Python handlers to the default action as it shuts down,
        and a SIGTERM then still killed the rank (measured with the default CPU model: exit -15 after its save).
        A launcher's SIGKILL (30 s after its SIGTERM) still ends a rank that hangs on the way out."""
        if self._previous is not None:
            signal.signal(self._sig, signal.SIG_IGN if self.stopped_by_signal else self._previous)
            self._previous = None
