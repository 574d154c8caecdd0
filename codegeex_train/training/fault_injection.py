"""Tests only: make chosen iterations' numbers bad, to test that the run stops on them (exit_conditions.py).

Chosen by ``CODEGEEX_TRAIN_TEST_INJECT`` in the environment of the ranks: "nan-loss@5" multiplies the model's
output by NaN at iteration 5 (NaN loss and gradients); "inf-grad@3,7-" keeps the loss finite and multiplies the
output's gradient by Inf at iteration 3 and from 7 on; "kill-job@5" sends SIGKILL to the rank's whole process group
(the launcher and every rank it started: a job killed by its scheduler) in iteration 5's forward. pretrain.py reads the variable once and, only when it is
set, hands the loop a ``step_context`` (its one seam, ``trainer.Run.step_context``); unset, nothing here runs.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path
from typing import Callable, ContextManager

import torch

TEST_INJECT_ENV = "CODEGEEX_TRAIN_TEST_INJECT"


def nan_output(module, inputs, output):
    return output * float("nan")


def inf_grad_output(module, inputs, output):
    if output.requires_grad:
        output.register_hook(lambda grad: grad * float("inf"))
    return output


def kill_job(module, inputs, output):
    """SIGKILL to the launcher (this rank's parent: torchrun, DeepSpeed's launch.py) and every process it started,
    this rank last: what a scheduler does to a job. Linux (/proc)."""
    parent, me = os.getppid(), os.getpid()
    siblings = []
    for entry in os.listdir("/proc"):
        try:  # /proc/PID/stat: "pid (name) state ppid ...", the name possibly holding spaces
            stat = Path("/proc", entry, "stat").read_text() if entry.isdigit() else ""
            if stat and int(stat.rpartition(")")[2].split()[1]) == parent:
                siblings.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    for pid in (parent, *(p for p in siblings if p != me), me):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def injection_from_spec(spec: str | None):
    """(forward hook, iteration -> bool) from ``TEST_INJECT_ENV``, or None."""
    if not spec:
        return None
    kind, _, iterations = spec.partition("@")
    hooks = {"nan-loss": nan_output, "inf-grad": inf_grad_output, "kill-job": kill_job}
    try:
        singles = {int(p) for p in iterations.split(",") if not p.endswith("-")}
        starts = [int(p[:-1]) for p in iterations.split(",") if p.endswith("-")]
        hook = hooks[kind]
    except (KeyError, ValueError):
        raise ValueError(f"{TEST_INJECT_ENV}={spec!r}: expected nan-loss@, inf-grad@ or kill-job@ITERATIONS "
                         f"(e.g. 5 or 3,7-)") from None
    return hook, lambda it: it in singles or any(it >= s for s in starts)


def step_context_from_environment(module: torch.nn.Module,
                                  environ=os.environ) -> Callable[[int], ContextManager] | None:
    """iteration -> a context that holds the injection's forward hook on ``module`` during the chosen
    iterations' steps; None when ``TEST_INJECT_ENV`` is unset."""
    injection = injection_from_spec(environ.get(TEST_INJECT_ENV))
    if injection is None:
        return None
    hook, chosen = injection

    @contextlib.contextmanager
    def step(iteration: int):
        handle = module.register_forward_hook(hook) if chosen(iteration) else None
        try:
            yield
        finally:
            if handle is not None:
                handle.remove()

    return step
