"""Keep a cheap op's output out of memory until backward needs it: selective recomputation.

    y = act(x)                                   # x is kept anyway (act's own backward needs it)
    with recompute_in_backward(y, act, x):
        out = linear(y)                          # would keep y, 4h wide: keeps a recipe instead

While the block runs, autograd saves ``y`` (by any op: a matmul's input, a custom Function's
``save_for_backward``) as the recipe ``act(x)``; the backward that needs it recomputes it, without grad, and
drops it when done. ``x`` must already be kept by someone (or the recipe keeps it alive: no saving). Every other
saved tensor is kept as usual; saved-tensor hooks do not nest (the innermost block wins), so a tally of saved
tensors (accounting's ``SavedActivations``) sees them through ``OBSERVERS``. No random op may be recomputed this
way (dropout needs ``checkpoint`` and its RNG restore).
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

# pack hooks of an enclosing tally; called for every tensor saved inside a block that is not the recipe's target
OBSERVERS: list[Callable[[torch.Tensor], object]] = []


def _matcher(target: torch.Tensor):
    """A test for "``saved`` is ``target`` or a reshaped view of it" (a matmul saves its 3-D input as (b*s, in)).
    It keeps the target's address and layout, not the tensor: holding the tensor would keep it alive until backward,
    which is the memory this module exists to free."""
    ptr, dtype, numel = target.data_ptr(), target.dtype, target.numel()
    shape, stride, contiguous = target.shape, target.stride(), target.is_contiguous()

    def same(saved: torch.Tensor) -> bool:
        if saved.data_ptr() != ptr or saved.dtype != dtype or saved.numel() != numel:
            return False
        return (saved.shape == shape and saved.stride() == stride) or (saved.is_contiguous() and contiguous)

    return same


class _Recipe:
    def __init__(self, fn, inputs, shape):
        self.fn, self.inputs, self.shape = fn, inputs, shape


@contextlib.contextmanager
def recompute_in_backward(target: torch.Tensor, fn: Callable[..., torch.Tensor], *inputs: torch.Tensor):
    """Inside the block, ``target`` (= ``fn(*inputs)``) is saved as a recipe and recomputed in backward."""

    same = _matcher(target)
    del target

    def pack(t: torch.Tensor):
        if same(t):
            return _Recipe(fn, tuple(i.detach() for i in inputs), t.shape)
        for observe in OBSERVERS:
            observe(t)
        return t

    def unpack(saved):
        if isinstance(saved, _Recipe):
            with torch.no_grad():
                value = saved.fn(*saved.inputs)
            return value if value.shape == saved.shape else value.reshape(saved.shape)
        return saved

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
