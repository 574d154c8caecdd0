"""Tensor-parallel layers against dense single-process references, on real gloo ranks.

Every rank builds the full dense reference (torch.nn.Linear / Embedding / F.cross_entropy) from the
same seed and compares its shard: forward outputs, input gradients, gathered weight and bias gradients.
"""

import pytest
import torch
import torch.nn.functional as F

from codegeex_train.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    init_normal,
    vocab_parallel_cross_entropy,
)
from tests.harness import all_gather_tensor, run_distributed

TOL = 1e-5
B, S, H, OUT, V = 2, 5, 8, 12, 24


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _chunk(t, dim, topo):
    return t.chunk(topo.tp_size, dim=dim)[topo.tp_rank]


def _gather(shard, dim, topo):
    return all_gather_tensor(shard, topo.tp_group, dim=dim)


def _close(actual, expected, what):
    err = (actual - expected).abs().max().item()
    assert err <= TOL, f"{what}: max abs error {err:.3g} > {TOL}"


def _dense_linear(in_features, out_features, seed):
    lin = torch.nn.Linear(in_features, out_features)
    torch.nn.init.normal_(lin.weight, 0.0, 0.05, generator=_gen(seed))
    with torch.no_grad():
        lin.bias.copy_(torch.randn(out_features, generator=_gen(seed + 1)))
    return lin


def check_column(topo, gather_output):
    x = torch.randn(B, S, H, generator=_gen(1), requires_grad=True)
    dense = _dense_linear(H, OUT, seed=10)
    layer = ColumnParallelLinear(H, OUT, topo.tp_group, gather_output=gather_output,
                                 init_method=init_normal(0.05, _gen(10)))
    with torch.no_grad():
        layer.bias.copy_(_chunk(dense.bias, 0, topo))
    grad_y = torch.randn(B, S, OUT, generator=_gen(2))

    y_ref = dense(x)
    (y_ref * grad_y).sum().backward()
    dx_ref, x.grad = x.grad.clone(), None

    y = layer(x)
    if gather_output:
        _close(y, y_ref, "column output (gathered)")
        (y * grad_y).sum().backward()
    else:
        _close(y, _chunk(y_ref, -1, topo), "column output shard")
        (y * _chunk(grad_y, -1, topo)).sum().backward()
    _close(x.grad, dx_ref, "column input grad")
    _close(_gather(layer.weight.grad, 0, topo), dense.weight.grad, "column weight grad")
    _close(_gather(layer.bias.grad, 0, topo), dense.bias.grad, "column bias grad")
    assert layer.weight.tensor_model_parallel and layer.weight.partition_dim == 0


def check_row(topo, input_is_parallel):
    x_full = torch.randn(B, S, OUT, generator=_gen(3))
    dense = _dense_linear(OUT, H, seed=20)
    layer = RowParallelLinear(OUT, H, topo.tp_group, input_is_parallel=input_is_parallel,
                              init_method=init_normal(0.05, _gen(20)))
    with torch.no_grad():
        layer.bias.copy_(dense.bias)
    grad_y = torch.randn(B, S, H, generator=_gen(4))

    x_ref = x_full.clone().requires_grad_()
    y_ref = dense(x_ref)
    (y_ref * grad_y).sum().backward()

    x = (_chunk(x_full, -1, topo) if input_is_parallel else x_full).clone().requires_grad_()
    y = layer(x)
    _close(y, y_ref, "row output")
    (y * grad_y).sum().backward()
    _close(x.grad, _chunk(x_ref.grad, -1, topo) if input_is_parallel else x_ref.grad, "row input grad")
    _close(_gather(layer.weight.grad, 1, topo), dense.weight.grad, "row weight grad")
    _close(layer.bias.grad, dense.bias.grad, "row bias grad")
    assert layer.weight.partition_dim == 1 and not hasattr(layer.bias, "tensor_model_parallel")


def check_embedding(topo):
    ids = torch.tensor([[0, V - 1, 7, 7, 12], [23, 1, 11, 12, 5]])  # ids in every partition, repeats
    dense = torch.nn.Embedding(V, H)
    torch.nn.init.normal_(dense.weight, 0.0, 1.0, generator=_gen(30))
    layer = VocabParallelEmbedding(V, H, topo.tp_group, init_method=init_normal(1.0, _gen(30)))
    grad_y = torch.randn(B, S, H, generator=_gen(5))
    y_ref, y = dense(ids), layer(ids)
    _close(y, y_ref, "embedding output")
    (y_ref * grad_y).sum().backward()
    (y * grad_y).sum().backward()
    _close(_gather(layer.weight.grad, 0, topo), dense.weight.grad, "embedding weight grad")


def check_cross_entropy(topo):
    logits_full = torch.randn(B, S, V, generator=_gen(6)) * 3
    # Targets fall in every partition (V/tp ranges), including the first and last id; two ignored.
    target = torch.tensor([[0, V - 1, 5, 6, 11], [12, 17, -100, 18, -100]])
    loss_mask = torch.tensor([[1.0, 1, 0, 1, 1], [1, 0, 1, 1, 1]])

    ref_logits = logits_full.clone().requires_grad_()
    ref_tok = F.cross_entropy(ref_logits.view(-1, V), target.view(-1), reduction="none").view(B, S)
    ref = (ref_tok * loss_mask).sum() / loss_mask.sum()
    ref.backward()

    for inplace in (False, True):
        leaf = _chunk(logits_full, -1, topo).clone().requires_grad_()
        shard = leaf * 1.0  # a non-leaf, as the model's logits are
        tok = vocab_parallel_cross_entropy(shard, target, topo.tp_group, inplace=inplace)
        # Without inplace the caller's logits are intact; with it they are scratch the loss overwrote.
        assert torch.equal(shard, _chunk(logits_full, -1, topo)) != inplace
        _close(tok, ref_tok, "per-token loss")
        assert (tok[target == -100] == 0).all()
        loss = (tok * loss_mask).sum() / loss_mask.sum()
        _close(loss, ref, "masked mean loss")
        loss.backward(retain_graph=True)
        _close(leaf.grad, _chunk(ref_logits.grad, -1, topo), "logits grad shard")
        assert leaf.grad[target == -100].abs().max() == 0
        # Backward turns the saved buffer into the gradient in place: a second pass must refuse, not be wrong.
        with pytest.raises(RuntimeError, match="backward through the same loss twice"):
            loss.backward()


def check_all_layers(topo):
    for flag in (False, True):
        check_column(topo, gather_output=flag)
        check_row(topo, input_is_parallel=flag)
    check_embedding(topo)
    check_cross_entropy(topo)
    return topo.tp_rank


@pytest.mark.parametrize("world,tp", [(1, 1), pytest.param(4, 2, marks=pytest.mark.slow),
                                      pytest.param(4, 4, marks=pytest.mark.slow)])
def test_layers_match_dense_reference(world, tp):
    # (4, 2) runs two TP groups side by side, so groups that do not contain rank 0 are exercised too.
    assert run_distributed(check_all_layers, world_size=world, tp_size=tp) == [r % tp for r in range(world)]


def check_bad_sizes(topo):
    with pytest.raises(ValueError, match=r"output size 6 is not divisible by --tensor-model-parallel-size 4"):
        ColumnParallelLinear(H, 6, topo.tp_group)
    with pytest.raises(ValueError, match=r"input size 10 is not divisible by --tensor-model-parallel-size 4"):
        RowParallelLinear(10, H, topo.tp_group)
    with pytest.raises(ValueError, match=r"vocabulary size 3 is smaller than --tensor-model-parallel-size 4"):
        VocabParallelEmbedding(3, H, topo.tp_group)
    with pytest.raises(ValueError, match=r"vocabulary size 10 is not divisible"):
        VocabParallelEmbedding(10, H, topo.tp_group)


@pytest.mark.slow
def test_bad_sizes_raise_clear_errors():
    run_distributed(check_bad_sizes, world_size=4, tp_size=4)
