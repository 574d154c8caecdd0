"""The model at TP=2 and TP=4 against TP=1 and a dense reference, on real gloo ranks.

Spawning ranks costs seconds, so each world size runs once (module-scoped fixtures) and returns the
measured errors; the tests below assert on them one property at a time.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from model_helpers import dense_logits, gather_full, hf_batch, make_batch, max_err, model_plan, tiny_config

from codegeex_train.accounting import CommCounter
from codegeex_train.checkpoint import load_model_checkpoint, partition_spec, split_state_dict
from codegeex_train.layout.recompute import Recompute
from codegeex_train.model import CodeGeeXModel, ModelConfigError, ModelGroups, count_parameters
from codegeex_train.model.init import ParamInit
from codegeex_train.model.transformer import ParallelTransformerLayer
from codegeex_train.tensor_parallel import model_parallel_seed
from tests.harness import run_distributed

TOL = 1e-5


def _parity(topo, top_query: bool) -> dict:
    config = tiny_config(top_query_layer=top_query)
    ids, pos, labels, weights = make_batch(config)
    ref = CodeGeeXModel(config, None, None, seed=11)
    model = CodeGeeXModel(config, ModelGroups.from_topology(topo), seed=11)
    expected = split_state_dict(ref.state_dict(), config, topo.tp_size)[topo.tp_rank]
    local = model.state_dict()
    out = {"init_equal": list(local) == list(expected) and all(torch.equal(local[k], expected[k]) for k in local)}

    logits_ref = ref(ids, pos)  # (b, s, v)
    out["logits_shard"] = max_err(model(ids, pos), logits_ref.chunk(topo.tp_size, -1)[topo.tp_rank])
    out["logits_gathered"] = max_err(model(ids, pos, gather_logits=True), logits_ref)
    full_weights = gather_full({n: p.detach() for n, p in model.named_parameters()}, config, topo.tp_group)
    out["dense_reference"] = max_err(model(ids, pos, gather_logits=True), dense_logits(full_weights, config, ids, pos))

    loss_ref, loss = ref(ids, pos, labels=labels), model(ids, pos, labels=labels)
    out["loss"] = max_err(loss, loss_ref)
    # The training loss: a masked mean over tokens (random weights so every token's grad differs).
    ((loss_ref * weights).sum() / weights.sum()).backward()
    ((loss * weights).sum() / weights.sum()).backward()
    grads = gather_full({n: p.grad for n, p in model.named_parameters()}, config, topo.tp_group)
    ref_params = dict(ref.named_parameters())
    out["grads"] = max(max_err(grads[n], ref_params[n].grad) for n in grads)
    out["grads_checked"] = len(grads) == len(ref_params)
    # Replicated parameters must get identical grads on every TP rank, or their copies drift apart.
    divergence = 0.0
    for n, p in model.named_parameters():
        if partition_spec(n, config) is None:
            first = p.grad.clone()
            dist.broadcast(first, src=topo.tp_ranks[0], group=topo.tp_group)
            divergence = max(divergence, max_err(p.grad, first))
    out["replicated_grad_divergence"] = divergence
    local_numel = sum(p.numel() for n, p in model.named_parameters() if partition_spec(n, config) is not None)
    total = torch.tensor([local_numel])
    dist.all_reduce(total, group=topo.tp_group)
    replicated = sum(p.numel() for n, p in model.named_parameters() if partition_spec(n, config) is None)
    out["param_count_matches"] = int(total) + replicated == count_parameters(config)
    return out


def _dropout_streams(topo) -> dict:
    """Record every attention-dropout and hidden-dropout call, infer each mask, compare across TP ranks."""
    config = tiny_config(hidden_dropout=0.2, attention_dropout=0.2)
    ids, pos, _, _ = make_batch(config)
    tracker = model_parallel_seed(1234, topo.tp_rank)
    model = CodeGeeXModel(config, ModelGroups.from_topology(topo), rng_tracker=tracker, seed=11).train()
    sdpa_calls, dropout_calls = [], []
    real_sdpa, real_dropout = F.scaled_dot_product_attention, F.dropout

    def sdpa(q, k, v, **kw):
        sdpa_calls.append((torch.get_rng_state(), q.detach(), k.detach(), v.detach(), kw))
        return real_sdpa(q, k, v, **kw)

    def dropout(x, p=0.5, training=True, inplace=False):
        y = real_dropout(x, p, training, inplace)
        dropout_calls.append(((y == 0) & (x != 0)).detach())  # dropped elements
        return y

    F.scaled_dot_product_attention, F.dropout = sdpa, dropout
    try:
        model(ids, pos)
    finally:
        F.scaled_dot_product_attention, F.dropout = real_sdpa, real_dropout

    def same_on_all_ranks(t):
        parts = [torch.empty_like(t) for _ in range(topo.tp_size)]
        dist.all_gather(parts, t.contiguous(), group=topo.tp_group)
        return all(torch.equal(parts[0], p) for p in parts[1:])

    out = {"attention_calls": len(sdpa_calls), "dropout_calls": len(dropout_calls), "attention_replay_exact": True,
           "attention_masks_differ": True, "attention_drop_fraction": []}
    for state, q, k, v, kw in sdpa_calls:
        assert kw["dropout_p"] == 0.2
        # Replaying the recorded RNG state with V = identity returns the dropped-out probabilities.
        torch.set_rng_state(state)
        again = real_sdpa(q, k, v, **kw)
        torch.set_rng_state(state)
        eye = torch.eye(q.shape[-2]).expand(*q.shape[:-1], q.shape[-2])
        probs = real_sdpa(q, k, eye, **kw)  # (b, n/tp, s, s)
        out["attention_replay_exact"] &= max_err(probs @ v, again) < 1e-6
        kept = torch.tril(torch.ones_like(probs, dtype=torch.bool))
        dropped = (probs == 0) & kept
        out["attention_drop_fraction"].append(dropped.sum().item() / kept.sum().item())
        out["attention_masks_differ"] &= not same_on_all_ranks(dropped)
    out["hidden_masks_identical"] = all(same_on_all_ranks(m) for m in dropout_calls)
    out["hidden_drop_fraction"] = [m.float().mean().item() for m in dropout_calls]
    return out


def _checkpointed(topo) -> dict:
    """Loss and grads with and without activation checkpointing, dropout on, the same RNG states."""
    config = tiny_config(hidden_dropout=0.2, attention_dropout=0.2)
    ids, pos, labels, weights = make_batch(config)
    tracker = model_parallel_seed(77, topo.tp_rank)
    cpu_state, tracker_states = torch.get_rng_state(), tracker.get_states()
    results = []
    for ckpt in (False, True):
        torch.set_rng_state(cpu_state)
        tracker.set_states(tracker_states)
        plan = model_plan(topo, recompute=Recompute.full() if ckpt else Recompute())  # --checkpoint-activations
        model = CodeGeeXModel(config, ModelGroups.from_topology(topo), plan, tracker, seed=11).train()
        loss = model(ids, pos, labels=labels)
        (loss * weights).sum().backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    with torch.no_grad():
        eval_loss = model.eval()(ids, pos, labels=labels)
    return {"loss": max_err(loss_a, loss_b), "grads": max(max_err(grads_a[n], grads_b[n]) for n in grads_a),
            "dropout_active": max_err(loss_a, eval_loss) > 1e-3}


def _all_reduce_counts(topo) -> dict:
    """(forward, backward) collectives of the MLP and the attention block, as CommCounter's (op, group, bytes)."""
    config = tiny_config()
    block = ParallelTransformerLayer(config, ModelGroups.from_topology(topo), model_plan(topo), None,
                                     ParamInit(1, 0.2, 2), "layers.0.")
    out = {}
    with CommCounter(topo.named_groups(), record=True) as comm:
        for name in ("mlp", "attention"):
            x = torch.randn(2, 16, config.hidden_size, requires_grad=True)
            comm.calls.clear()
            y = getattr(block, name)(x)
            forward = list(comm.calls)
            y.sum().backward()
            out[name] = (forward, comm.calls[len(forward):])
    return out


def _bad_configs(topo) -> dict:
    """The errors of two configs that TP 2 cannot split, and every collective issued while they were rejected."""
    messages = []
    with CommCounter(topo.named_groups(), record=True) as comm:
        for bad in (dict(num_attention_heads=3, hidden_size=33), dict(vocab_size=99, make_vocab_size_divisible_by=3)):
            try:
                CodeGeeXModel(tiny_config(**bad), ModelGroups.from_topology(topo))
            except ModelConfigError as e:
                messages.append(str(e))
    ok = torch.ones(1)
    dist.all_reduce(ok, group=topo.tp_group)  # the ranks are still in step
    return {"messages": messages, "collectives": comm.calls}


def _hf_logits(topo, ckpt_dir: str, config, hf_logits: torch.Tensor) -> float:
    model = CodeGeeXModel(config, ModelGroups.from_topology(topo), seed=0).eval()
    meta = load_model_checkpoint(ckpt_dir, model)
    assert meta["tp_size"] == topo.tp_size
    ids, pos = hf_batch(config)
    with torch.no_grad():
        logits = model(ids, pos, gather_logits=True)[..., : config.vocab_size]
    return max_err(logits, hf_logits)


def tp_suite(topo, hf=None) -> dict:
    out = {"parity_top_query": _parity(topo, True), "parity_gpt2": _parity(topo, False)}
    if topo.tp_size == 2:
        out.update(dropout=_dropout_streams(topo), checkpointed=_checkpointed(topo), bad_configs=_bad_configs(topo),
                   all_reduces=_all_reduce_counts(topo))
        if hf is not None:
            out["hf_logits"] = _hf_logits(topo, **hf)
    return out


@pytest.fixture(scope="module")
def tp2(hf_checkpoints):
    hf = {"ckpt_dir": str(hf_checkpoints["ckpt"][2]), "config": hf_checkpoints["config"],
          "hf_logits": hf_checkpoints["logits"]}
    return run_distributed(tp_suite, world_size=2, tp_size=2, hf=hf)


@pytest.fixture(scope="module")
def tp4():
    return run_distributed(tp_suite, world_size=4, tp_size=4)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("variant", ["parity_top_query", "parity_gpt2"])
def test_tp_matches_tp1(request, tp, variant):
    for rank, result in enumerate(request.getfixturevalue(f"tp{tp}")):
        r = result[variant]
        assert r["init_equal"], f"rank {rank}: TP={tp} init is not the TP=1 init split"
        assert r["grads_checked"] and r["param_count_matches"]
        for key in ("logits_shard", "logits_gathered", "loss", "grads", "replicated_grad_divergence"):
            assert r[key] <= TOL, f"rank {rank} TP={tp} {variant}: {key} max error {r[key]:.3g} > {TOL}"
        assert r["dense_reference"] <= TOL, f"dense reference: {r['dense_reference']:.3g}"


def test_attention_dropout_differs_across_tp_ranks_hidden_dropout_identical(tp2):
    for r in (res["dropout"] for res in tp2):
        assert r["attention_calls"] == 3 and r["dropout_calls"] == 1 + 2 * 3  # embedding + 2 per layer
        assert r["attention_replay_exact"], "replaying the recorded RNG state did not reproduce SDPA's output"
        assert r["attention_masks_differ"], "attention dropout masks are equal on the TP ranks"
        assert r["hidden_masks_identical"], "hidden dropout masks differ between TP ranks"
        assert all(0.1 < f < 0.3 for f in r["attention_drop_fraction"] + r["hidden_drop_fraction"])


def test_activation_checkpointing_is_exact_with_dropout(tp2):
    for r in (res["checkpointed"] for res in tp2):
        assert r["dropout_active"]
        assert r["loss"] == 0.0 and r["grads"] <= 1e-7, r


def test_mlp_and_attention_all_reduce_once_forward_once_backward(tp2):
    block_out = [("all_reduce", "tp", 2 * 2 * 16 * tiny_config().hidden_size * 4)]  # (2, 16, h) fp32, 2x
    for result in tp2:
        assert result["all_reduces"] == {"mlp": (block_out, block_out), "attention": (block_out, block_out)}


def test_bad_config_raises_before_any_collective(tp2):
    for result in (res["bad_configs"] for res in tp2):
        assert result["collectives"] == []  # counted, not inferred: nothing was issued before the errors
        messages = result["messages"]
        assert len(messages) == 2
        assert "--num-attention-heads 3" in messages[0] or "--hidden-size 33" in messages[0]
        assert "padded vocabulary 99" in messages[1] and "--tensor-model-parallel-size 2" in messages[1]


def test_hf_gpt2_converted_to_tp2_matches_hf(tp2):
    for result in tp2:
        assert result["hf_logits"] <= 1e-4, result["hf_logits"]
