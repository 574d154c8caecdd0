"""recompute_in_backward: the target is neither saved nor kept alive by the block (only its recipe is), and the
gradients equal the plain computation's bit for bit; a reshaped view of the target (a matmul's 2-D input) counts."""

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

from codegeex_train.tensor_parallel import recompute_in_backward


def _run(recompute: bool, x: torch.Tensor, w: torch.Tensor):
    pre = F.linear(x, w)
    inner = F.gelu(pre)
    alive = weakref.ref(inner)
    if recompute:
        with recompute_in_backward(inner, F.gelu, pre):
            out = F.linear(inner, w.t())
    else:
        out = F.linear(inner, w.t())
    del inner
    gc.collect()
    kept = alive() is not None
    out.square().sum().backward()
    return kept


@pytest.mark.parametrize("shape", [(8, 16), (2, 4, 16)])
def test_target_is_freed_and_gradients_are_exact(shape):
    grads = {}
    for recompute in (False, True):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(0), requires_grad=True)
        w = torch.randn(32, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
        kept = _run(recompute, x, w)
        assert kept is (not recompute)  # plain: the matmul keeps its input; recomputed: nobody does
        grads[recompute] = (x.grad, w.grad)
    assert all(torch.equal(a, b) for a, b in zip(grads[False], grads[True]))
