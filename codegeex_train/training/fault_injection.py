"""Tests only: make chosen iterations' numbers bad, to test that the run stops on them (exit_conditions.py).

A forward hook on the model, chosen by ``CODEGEEX_TRAIN_TEST_INJECT``: "nan-loss@5" multiplies
the model's output by NaN at iteration 5 (NaN loss and gradients); "inf-grad@3,7-" keeps the loss finite and
multiplies the output's gradient by Inf at iteration 3 and from 7 on.
"""

from __future__ import annotations

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
