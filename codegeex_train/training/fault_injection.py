"""Tests only: make chosen iterations' numbers bad, to test that the run stops on them (exit_conditions.py).

Chosen by ``CODEGEEX_TRAIN_TEST_INJECT`` in the environment of the ranks: "nan-loss@5" multiplies the model's
output by NaN at iteration 5 (NaN loss and gradients); "inf-grad@3,7-" keeps the loss finite and multiplies the
output's gradient by Inf at iteration 3 and from 7 on. pretrain.py reads the variable once and, only when it is
set, hands the loop a ``step_context`` (its one seam, ``trainer.Run.step_context``); unset, nothing here runs.
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, ContextManager

import torch

TEST_INJECT_ENV = "CODEGEEX_TRAIN_TEST_INJECT"


def nan_output(module, inputs, output):
    return output * float("nan")


def inf_grad_output(module, inputs, output):
    if output.requires_grad:
        output.register_hook(lambda grad: grad * float("inf"))
    return output


def injection_from_spec(spec: str | None):
    """(forward hook, iteration -> bool) from ``TEST_INJECT_ENV``, or None."""
    if not spec:
        return None
    kind, _, iterations = spec.partition("@")
    hooks = {"nan-loss": nan_output, "inf-grad": inf_grad_output}
    try:
        singles = {int(p) for p in iterations.split(",") if not p.endswith("-")}
        starts = [int(p[:-1]) for p in iterations.split(",") if p.endswith("-")]
        hook = hooks[kind]
    except (KeyError, ValueError):
        raise ValueError(f"{TEST_INJECT_ENV}={spec!r}: expected nan-loss@ITERATIONS or inf-grad@ITERATIONS "
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
