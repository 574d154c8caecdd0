"""The model core of the Llama-shaped options (--normalization RMSNorm, --swiglu, --disable-bias-linear,
--untie-embeddings-and-output-weights) against an independent reference: ``transformers``' own LlamaForCausalLM, its
weights copied into ours by name (q/k/v -> query_key_value, gate/up -> dense_h_to_4h, lm_head -> output_layer).
Logits, the per-token loss, the gradient of every weight and, across a pipeline stage boundary, of the boundary's
hidden states, in fp32 at TP 1 / 2 / 4, PP 2 (stage models chained), sequence parallelism and selective and full
recompute; with and without biases, tied and untied.

Also: every combination of the architecture switches builds a model whose state dict is ``model_parameter_shapes``
(names, order, shapes) and whose tensor-parallel tags are ``partition_spec``; checkpoints of it split, save, load and
re-shard at TP x PP exactly; and at PP 2 an untied model's word table and output layer stay apart (no shared-embedding
collective) while a tied one's two copies are still synced and their gradients summed.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from model_helpers import B, S, SavedBytes, gather_full, make_batch, max_err, model_plan, tiny_config

from codegeex_train.accounting import CommCounter
from codegeex_train.checkpoint import (
    load_full_state_dict,
    load_model_checkpoint,
    merge_state_dicts,
    partition_spec,
    save_model_checkpoint,
    split_model_parallel,
    split_state_dict,
)
from codegeex_train.checkpoint.files import rank_parameter_shapes
from codegeex_train.model.shapes import model_parameter_shapes
from codegeex_train.layout.plan import ParallelPlan
from codegeex_train.layout.recompute import Recompute
from codegeex_train.layout.stages import stage_layer_ranges
from codegeex_train.model import CodeGeeXModel, ModelGroups, count_parameters
from codegeex_train.pipeline import allreduce_shared_embedding_grads, mark_shared_embedding_copy, sync_shared_embedding
from tests.harness import checkpoint_at, load_tool, metrics_records, run_distributed, run_pretrain, tiny_pretrain_args

TOL = 1e-5
# Llama's shape: RMSNorm, SwiGLU, RoPE, no top query layer; the vocabulary unpadded, so the loss is over the same
# columns as the reference's.
LLAMA = dict(normalization="RMSNorm", swiglu=True, activation="gelu", position_embedding_type="rope",
             top_query_layer=False, vocab_size=128, ffn_hidden_size=64, layernorm_epsilon=1e-6)


def core_config(bias: bool = False, tied: bool = False, **overrides):
    return tiny_config(**LLAMA, disable_bias_linear=not bias, untie_embeddings_and_output_weights=not tied,
                       **overrides)


# --- The reference: transformers' LlamaForCausalLM ------------------------------------------------------------

def llama(config, seed: int = 0):
    """A LlamaForCausalLM of ``config``'s shape, every weight (norms, biases included) drawn at random."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_config = LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.ffn_hidden_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.kv_groups, max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.layernorm_epsilon, rope_theta=float(config.rotary_base),
        attention_bias=config.linear_bias, mlp_bias=config.linear_bias, tie_word_embeddings=config.tied_output)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(hf_config)
    with torch.no_grad():  # HF starts norms at 1 and biases at 0: move all, so that each mapping matters
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model


def llama_to_full(hf: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """Llama tensors (weights or their gradients) by our names, in our order."""
    full = {"word_embeddings.weight": hf["model.embed_tokens.weight"]}
    suffixes = ("weight", "bias") if config.linear_bias else ("weight",)
    for i in range(config.num_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        attn, mlp = theirs + "self_attn.", theirs + "mlp."
        full[ours + "input_layernorm.weight"] = hf[theirs + "input_layernorm.weight"]
        for s in suffixes:
            full[ours + f"attention.query_key_value.{s}"] = torch.cat([hf[attn + f"{p}_proj.{s}"] for p in "qkv"])
        for s in suffixes:
            full[ours + f"attention.dense.{s}"] = hf[attn + f"o_proj.{s}"]
        full[ours + "post_attention_layernorm.weight"] = hf[theirs + "post_attention_layernorm.weight"]
        for s in suffixes:
            full[ours + f"mlp.dense_h_to_4h.{s}"] = torch.cat([hf[mlp + f"gate_proj.{s}"], hf[mlp + f"up_proj.{s}"]])
        for s in suffixes:
            full[ours + f"mlp.dense_4h_to_h.{s}"] = hf[mlp + f"down_proj.{s}"]
    full["final_layernorm.weight"] = hf["model.norm.weight"]
    if not config.tied_output:
        full["output_layer.weight"] = hf["lm_head.weight"]
    return full


def weighted_loss(per_token: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (per_token * weights).sum() / weights.sum()


def reference(config, seed: int = 0) -> dict:
    """The Llama model's weights (ours by name), logits, per-token loss, gradients, and the gradient of the hidden
    states after layer ``num_layers // 2 - 1`` (the PP 2 stage boundary), on ``make_batch``'s batch."""
    model = llama(config, seed)
    ids, pos, labels, weights = make_batch(config)
    boundary = {}

    def keep(module, args, out):
        hidden = out[0] if isinstance(out, tuple) else out
        hidden.retain_grad()
        boundary["hidden"] = hidden

    hook = model.model.layers[config.num_layers // 2 - 1].register_forward_hook(keep)
    logits = model(input_ids=ids, position_ids=pos).logits  # (b, s, v)
    hook.remove()
    per_token = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(B, S)
    weighted_loss(per_token, weights).backward()
    weights_sd = llama_to_full({n: p.detach() for n, p in model.named_parameters()}, config)
    grads = llama_to_full({n: p.grad for n, p in model.named_parameters()}, config)
    return {"weights": weights_sd, "logits": logits.detach(), "loss": per_token.detach(), "grads": grads,
            "boundary_grad": boundary["hidden"].grad}


# --- Ours: the model at a layout, loaded with the reference's weights ------------------------------------------

def _gather_sequence(t: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def ours(config, ref: dict, topo=None, *, pp: int = 1, sequence_parallel: bool = False,
         recompute: Recompute = Recompute()) -> dict:
    """Our model at TP (``topo``'s, or 1), ``pp`` stage models chained in this process, SP and recompute as given,
    loaded with the reference's weights: the errors against the reference."""
    groups = ModelGroups() if topo is None else ModelGroups.from_topology(topo)
    tp_group = None if topo is None else topo.tp_group
    plan = model_plan(topo, sequence_parallel=sequence_parallel, recompute=recompute)
    shard = split_state_dict(ref["weights"], config, groups.tp_size)[groups.tp_rank]
    stage_layers = stage_layer_ranges(config.num_layers, pp)
    stages = [CodeGeeXModel(config, groups, plan, seed=3, pre_process=i == 0, post_process=i == pp - 1,
                            layer_numbers=layers) for i, layers in enumerate(stage_layers)]
    for stage in stages:
        stage.load_state_dict({name: shard[name] for name in stage.state_dict()})
    ids, pos, labels, weights = make_batch(config)
    x, sent = ids, []
    for stage in stages[:-1]:  # each stage's output leaves the graph and re-enters the next, as p2p does
        hidden = stage(x, pos)
        x = hidden.detach().requires_grad_()
        sent.append((hidden, x))
    loss = stages[-1](x, pos, labels=labels)  # (b, s) the whole sequence on every TP rank
    weighted_loss(loss, weights).backward()
    for hidden, received in reversed(sent):
        hidden.backward(received.grad)
    with torch.no_grad():
        logits = stages[-1](x, pos, gather_logits=True)  # (b, s, v)
    local_grads = {}  # tied at PP > 1: the two copies' gradients summed, as the shared-embedding all-reduce does
    for stage in stages:
        for n, p in stage.named_parameters():
            local_grads[n] = local_grads[n] + p.grad if n in local_grads else p.grad
    grads = local_grads if topo is None else gather_full(local_grads, config, tp_group)
    out = {"logits": max_err(logits, ref["logits"]), "loss": max_err(loss, ref["loss"]),
           "names": list(grads) == list(ref["grads"]),
           "grads": {n: max_err(grads[n], ref["grads"][n]) / max(1.0, ref["grads"][n].abs().max().item())
                     for n in ref["grads"]}}
    if sent:
        boundary = sent[0][1].grad
        if sequence_parallel and topo is not None and groups.tp_size > 1:
            boundary = _gather_sequence(boundary, tp_group)  # (b, s/tp, h) per rank -> (b, s, h)
        out["boundary_grad"] = max_err(boundary, ref["boundary_grad"])
    return out


def assert_matches(result: dict, what: str) -> None:
    assert result["names"], f"{what}: the gradients are not the reference's parameters"
    worst = max(result["grads"], key=result["grads"].get)
    assert result["logits"] <= TOL and result["loss"] <= TOL, f"{what}: {result['logits']=:.3g} {result['loss']=:.3g}"
    assert result["grads"][worst] <= TOL, f"{what}: gradient of {worst} off by {result['grads'][worst]:.3g}"
    assert result.get("boundary_grad", 0.0) <= TOL, f"{what}: stage boundary gradient {result['boundary_grad']:.3g}"


# --- One process: TP 1, PP 1 and 2 ------------------------------------------------------------------------------

@pytest.mark.parametrize("bias,tied,pp,groups", [(False, False, 1, None), (True, False, 1, None),
                                                 (False, True, 1, None), (False, False, 2, None), (False, True, 2, 2)],
                         ids=["no-bias", "bias", "tied", "pp2", "tied-pp2-gqa"])
def test_llama_shape_matches_transformers(bias, tied, pp, groups):
    config = core_config(bias=bias, tied=tied, group_query_attention=groups is not None, num_query_groups=groups)
    ref = reference(config)
    assert ref["logits"].abs().max() > 1.0 and min(g.abs().max() for g in ref["grads"].values()) > 0
    assert_matches(ours(config, ref, pp=pp), f"bias {bias}, tied {tied}, PP {pp}")


def test_rmsnorm_forward_is_hf_bit_for_bit():
    """fp32: our RMSNorm gives LlamaRMSNorm's numbers exactly; bf16: the same order of casts, so the same numbers."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from codegeex_train.model.norms import RMSNorm

    config = core_config(hidden_size=64)
    for dtype in (torch.float32, torch.bfloat16):
        ours_norm, theirs = RMSNorm(config, dtype, None), LlamaRMSNorm(64, eps=config.layernorm_epsilon).to(dtype)
        with torch.no_grad():
            ours_norm.weight.normal_()
            theirs.weight.copy_(ours_norm.weight)
        x = (torch.randn(3, 5, 64) * 4).to(dtype)
        assert torch.equal(ours_norm(x), theirs(x)), dtype


def test_swiglu_and_rmsnorm_backward_match_autograd():
    """The hand-written backwards against autograd through the plain formulas, float64."""
    from codegeex_train.model.mlp import swiglu
    from codegeex_train.model.norms import RMSNorm

    torch.manual_seed(0)
    x = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(2, 5, 8, dtype=torch.float64)
    (swiglu(x) * grad).sum().backward()
    ours_grad, x.grad = x.grad, None
    gate, up = x.chunk(2, -1)
    (F.silu(gate) * up * grad).sum().backward()
    assert max_err(ours_grad, x.grad) < 1e-12

    norm = RMSNorm(core_config(hidden_size=16), torch.float64, None)
    with torch.no_grad():
        norm.weight.normal_()
    grad = torch.randn(2, 5, 16, dtype=torch.float64)
    x.grad = None
    (norm(x) * grad).sum().backward()
    ours_x, ours_w = x.grad, norm.weight.grad
    x.grad = None
    w = norm.weight.detach().clone().requires_grad_()
    (w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * grad).sum().backward()
    assert max_err(ours_x, x.grad) < 1e-12 and max_err(ours_w, w.grad) < 1e-12


def test_rmsnorm_and_swiglu_keep_their_input_only():
    """What backward keeps (activation memory): RMSNorm its input and the (b, s, 1) fp32 statistic, as LayerNorm
    does; SwiGLU its (b, s, 2 ffn) input. bf16, as trained."""
    from codegeex_train.model.mlp import swiglu
    from codegeex_train.model.norms import RMSNorm

    norm = RMSNorm(core_config(hidden_size=64), torch.bfloat16, None)
    x = torch.randn(B, S, 64, dtype=torch.bfloat16, requires_grad=True)
    with SavedBytes(norm) as saved:
        norm(x)
    assert saved.bytes == x.nbytes + B * S * 4
    pre = torch.randn(B, S, 2 * 48, dtype=torch.bfloat16, requires_grad=True)
    with SavedBytes(norm) as saved:
        swiglu(pre)
    assert saved.bytes == pre.nbytes


@pytest.mark.parametrize("modules", [("layernorm",), ("mlp_act",), ("core_attn",)])
def test_each_selective_recompute_keeps_less(modules):
    """Selective recompute of the norms' outputs and of the SwiGLU output really drops them (and core attention's
    part), bitwise the same loss and gradients."""
    config = core_config()
    ids, pos, labels, weights = make_batch(config)
    runs = []
    for recompute in (Recompute(), Recompute("selective", modules=modules)):
        model = CodeGeeXModel(config, None, model_plan(recompute=recompute), seed=3)
        with SavedBytes(model) as saved:
            loss = model(ids, pos, labels=labels)
        weighted_loss(loss, weights).backward()
        runs.append((saved.bytes, loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (plain, loss, grads), (fewer, loss_r, grads_r) = runs
    assert fewer < plain, (modules, fewer, plain)
    assert torch.equal(loss, loss_r) and all(torch.equal(grads[n], grads_r[n]) for n in grads)


# --- Real ranks: TP 2 and TP 4 ----------------------------------------------------------------------------------

TP2_VARIANTS = {
    "plain": {},
    "bias": {"bias": True},
    "tied": {"tied": True},
    "sp": {"sequence_parallel": True},
    "selective": {"recompute": Recompute("selective", modules=("core_attn", "mlp_act", "layernorm"))},
    "sp selective": {"sequence_parallel": True, "recompute": Recompute("selective", modules=("mlp_act", "layernorm"))},
    "full": {"recompute": Recompute("full", "uniform", 1)},
    "pp2": {"pp": 2},
    "tied pp2 gqa": {"tied": True, "pp": 2, "groups": 2},
    "pp2 sp full": {"pp": 2, "sequence_parallel": True, "recompute": Recompute("full", "uniform", 1)},
}
TP4_VARIANTS = ("plain", "sp", "pp2")


def _init_equal(topo, config) -> bool:
    """The TP-sharded model is the TP 1 model's weights split (the initialisation depends on no TP size)."""
    local = CodeGeeXModel(config, ModelGroups.from_topology(topo), seed=11).state_dict()
    expected = split_state_dict(CodeGeeXModel(config, None, None, seed=11).state_dict(), config,
                                topo.tp_size)[topo.tp_rank]
    return list(local) == list(expected) and all(torch.equal(local[k], expected[k]) for k in local)


def tp_suite(topo, variants) -> dict:
    out = {"init_equal": _init_equal(topo, core_config(bias=True))}
    for name in variants:
        options = dict(TP2_VARIANTS[name])
        groups = options.pop("groups", None)
        config = core_config(bias=options.pop("bias", False), tied=options.pop("tied", False),
                             group_query_attention=groups is not None, num_query_groups=groups)
        out[name] = ours(config, reference(config), topo, **options)
    return out


@pytest.fixture(scope="module")
def tp2():
    return run_distributed(tp_suite, world_size=2, tp_size=2, variants=list(TP2_VARIANTS))


@pytest.fixture(scope="module")
def tp4():
    return run_distributed(tp_suite, world_size=4, tp_size=4, variants=list(TP4_VARIANTS))


@pytest.mark.slow
@pytest.mark.parametrize("tp,variant", [*((2, v) for v in TP2_VARIANTS), *((4, v) for v in TP4_VARIANTS)])
def test_tensor_parallel_matches_transformers(request, tp, variant):
    for rank, result in enumerate(request.getfixturevalue(f"tp{tp}")):
        assert_matches(result[variant], f"TP {tp} rank {rank} {variant}")


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_init_is_the_split_of_tp1(request, tp):
    assert all(result["init_equal"] for result in request.getfixturevalue(f"tp{tp}"))


# --- Every combination of the switches: parameters, tags, counts, checkpoints ---------------------------------

def _switches():
    """Each combination of the norm, the MLP, the output layer, the biases and the attention's groups; the top query
    layer and the position scheme alternate over them (their own tests cover them)."""
    combos = itertools.product(("LayerNorm", "RMSNorm"), (False, True), (False, True),
                               ("all", "none", "qkv"), (False, True))
    for i, (norm, swiglu, untied, bias, gqa) in enumerate(combos):
        yield dict(normalization=norm, swiglu=swiglu, activation="gelu", untie_embeddings_and_output_weights=untied,
                   disable_bias_linear=bias != "all", add_qkv_bias=bias == "qkv", group_query_attention=gqa,
                   num_query_groups=2 if gqa else None, top_query_layer=i % 2 == 0,
                   position_embedding_type=("rope", "learned_absolute")[i // 2 % 2])


def test_every_combination_builds_the_documented_parameters():
    """The state dict is ``model_parameter_shapes`` (names, order, shapes), each tensor-parallel tag is
    ``partition_spec``'s, the count is ``count_parameters``, and each PP 2 stage holds ``rank_parameter_shapes``."""
    for switches in _switches():
        config = tiny_config(**switches)
        config.check_architecture()
        model = CodeGeeXModel(config, None, None)
        shapes = [(n, tuple(t.shape)) for n, t in model.state_dict().items()]
        assert shapes == list(model_parameter_shapes(config).items()), switches
        for name, p in model.named_parameters():
            tagged = (p.partition_dim, p.partition_stride) if getattr(p, "tensor_model_parallel", False) else None
            assert partition_spec(name, config) == tagged, (name, switches)
        assert count_parameters(config) == sum(p.numel() for p in model.parameters()), switches
        stage_layers = stage_layer_ranges(config.num_layers, 2)
        for pp_rank, layers in enumerate(stage_layers):
            stage = CodeGeeXModel(config, None, None, pre_process=pp_rank == 0, post_process=pp_rank == 1,
                                  layer_numbers=layers)
            assert ({n: tuple(t.shape) for n, t in stage.state_dict().items()}
                    == rank_parameter_shapes(config, 1, stage_layers, pp_rank)), (pp_rank, switches)
        untied = not config.tied_output
        assert ("output_layer.weight" in model.state_dict()) == untied
        assert getattr(model.word_embeddings.weight, "shared_embedding", False) != untied
        assert not hasattr(getattr(model, "output_layer", None), "shared_embedding")


def test_untied_stages_hold_the_word_table_first_and_the_output_layer_last():
    config = core_config()
    first, last = (CodeGeeXModel(config, None, None, pre_process=r == 0, post_process=r == 1,
                                 layer_numbers=[r]) for r in range(2))
    assert hasattr(first, "word_embeddings") and not hasattr(first, "output_layer")
    assert hasattr(last, "output_layer") and not hasattr(last, "word_embeddings")
    assert list(last.state_dict())[-1] == "output_layer.weight"
    assert not torch.equal(last.output_layer.weight, first.word_embeddings.weight)  # seeded by their own names


@pytest.mark.parametrize("tp", [2, 4])
def test_split_then_merge_is_identity_with_groups_and_swiglu(tp):
    config = core_config(bias=True, num_attention_heads=8, group_query_attention=True, num_query_groups=4)
    full = {k: torch.randn(v.shape) for k, v in CodeGeeXModel(config, None, None).state_dict().items()}
    shards = split_state_dict(full, config, tp)
    ffn = config.ffn_hidden_size
    for rank, shard in enumerate(shards):  # rank r holds [gate_r; up_r]
        gate, up = full["layers.0.mlp.dense_h_to_4h.weight"].split(ffn)
        expected = torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
        assert torch.equal(shard["layers.0.mlp.dense_h_to_4h.weight"], expected)
        assert shard["output_layer.weight"].shape == (config.padded_vocab_size // tp, config.hidden_size)
    merged = merge_state_dicts(shards, config)
    assert list(merged) == list(full) and all(torch.equal(merged[k], full[k]) for k in full)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_checkpoint_at_tp_x_pp_round_trips_and_reshards_exactly(convert, tmp_path, tied):
    """Split for TP 2 x PP 2, saved, each stage model loads its files strictly; re-sharded to 1 x 4 and to 1 x 1 by
    tools/convert_checkpoint.py, the full weights come back bit for bit."""
    config = core_config(bias=False, tied=tied, num_layers=4, group_query_attention=True, num_query_groups=2)
    g = torch.Generator().manual_seed(5)
    full = {k: torch.randn(v.shape, generator=g) for k, v in CodeGeeXModel(config, None, None).state_dict().items()}
    stage_layers = stage_layer_ranges(4, 2)
    shards = split_model_parallel(full, config, 2, stage_layers)
    assert ["word_embeddings.weight" in s for s in shards] == [True, True, tied, tied]
    assert ["output_layer.weight" in s for s in shards] == [False, False, not tied, not tied]
    save_model_checkpoint(tmp_path / "2x2", shards, config, 2, pp_size=2)
    convert.main(["--load", str(tmp_path / "2x2"), "--save", str(tmp_path / "1x4"),
                  "--pipeline-model-parallel-size", "4"])
    convert.main(["--load", str(tmp_path / "1x4"), "--save", str(tmp_path / "1x1")])
    for name in ("2x2", "1x4", "1x1"):
        loaded, _, _ = load_full_state_dict(tmp_path / name)
        assert list(loaded) == list(full) and all(torch.equal(loaded[k], full[k]) for k in full), name
    four = stage_layer_ranges(4, 4)
    for pp_rank in range(4):  # strict: each file holds exactly its stage's parameters
        stage = CodeGeeXModel(config, None, None, pre_process=pp_rank == 0, post_process=pp_rank == 3,
                              layer_numbers=four[pp_rank])
        load_model_checkpoint(tmp_path / "1x4", stage, pp_size=4, pp_rank=pp_rank)
        assert all(torch.equal(t, full[n]) for n, t in stage.state_dict().items())


@pytest.mark.parametrize("run_overrides, named", [
    (dict(swiglu=False), "--swiglu"),
    (dict(normalization="LayerNorm"), "--normalization RMSNorm"),
    (dict(untie_embeddings_and_output_weights=False), "--untie-embeddings-and-output-weights"),
    (dict(disable_bias_linear=False), "--disable-bias-linear"),
    (dict(group_query_attention=False, num_query_groups=None), "--group-query-attention --num-query-groups 2"),
])
def test_loading_with_another_architecture_names_the_flag(tmp_path, run_overrides, named):
    from codegeex_train.checkpoint import CheckpointError, load_model_shard
    from codegeex_train.checkpoint.resume import preflight_resume
    from codegeex_train.config.arguments import ConfigError
    from codegeex_train.layout.dims import ParallelDims

    saved = core_config(group_query_attention=True, num_query_groups=2)
    save_model_checkpoint(tmp_path, [CodeGeeXModel(saved, None, None).state_dict()], saved, 1)
    run = tiny_config(**{**LLAMA, "disable_bias_linear": True, "untie_embeddings_and_output_weights": True,
                         "group_query_attention": True, "num_query_groups": 2, **run_overrides})
    with pytest.raises(ConfigError, match="use the same model flags as the checkpoint .*" + named):
        preflight_resume(str(tmp_path), run, ParallelDims(1))
    with pytest.raises(CheckpointError, match="has .*; this run has"):
        load_model_shard(tmp_path, run, tp_size=1, tp_rank=0)


# --- PP 2 on real ranks: the shared-embedding machinery ----------------------------------------------------------

def _shared_embedding(topo, tied: bool) -> dict:
    """A PP 2 stage of a tied or untied model; its output table starts different from the first stage's. Runs the
    start-up sync and the gradient sum (tied: DeepSpeed's full-gradient accessors replaced by the plain ``.grad``, as
    ZeRO is not running; untied: nothing of DeepSpeed's may be reached) and records every collective they issue."""
    if tied:
        import deepspeed.utils

        deepspeed.utils.safe_get_full_grad = lambda p: p.grad.clone()
        deepspeed.utils.safe_set_full_grad = lambda p, g: p.grad.copy_(g)
    config = core_config(tied=tied)
    plan = ParallelPlan.derive(topo.dims, micro_batch_size=1, num_layers=config.num_layers)
    model = CodeGeeXModel.for_rank(config, plan, topo, None, seed=3)
    output = model.output_weight if topo.is_last_stage else None
    if output is not None:
        with torch.no_grad():
            output.add_(1.0)  # the last stage's table, different from the first stage's
    mark_shared_embedding_copy(model, topo)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1.0 + topo.pp_rank)
    with CommCounter(topo.named_groups(), record=True) as comm:
        sync_shared_embedding(model, topo)
        allreduce_shared_embedding_grads(model, topo)
    table = model.word_embeddings.weight if topo.is_first_stage else output
    grad_of = {n: p.grad for n, p in model.named_parameters()}
    name = "word_embeddings.weight" if topo.is_first_stage else "output_layer.weight" if not tied else \
        "word_embeddings.weight"
    return {"collectives": [c[0] for c in comm.calls], "table": table.detach().numpy().copy(),
            "table_grad": grad_of[name].numpy().copy(),
            "replicated_tag": [n for n, p in model.named_parameters() if getattr(p, "ds_pipe_replicated", False)],
            "names": list(grad_of)}


def test_untied_pp2_has_no_shared_embedding_collective():
    first, last = run_distributed(_shared_embedding, world_size=2, pp_size=2, tied=False)
    assert first["collectives"] == [] and last["collectives"] == []
    assert "output_layer.weight" in last["names"] and "word_embeddings.weight" not in last["names"]
    assert "output_layer.weight" not in first["names"]
    assert not np.array_equal(first["table"], last["table"])  # kept apart: no sync copied one onto the other
    assert (first["table_grad"] == 1.0).all() and (last["table_grad"] == 2.0).all()  # each its own gradient
    assert first["replicated_tag"] == [] and last["replicated_tag"] == []


@pytest.mark.slow
def test_tied_pp2_still_syncs_and_sums():
    first, last = run_distributed(_shared_embedding, world_size=2, pp_size=2, tied=True)
    assert first["collectives"] == last["collectives"] == ["broadcast", "all_reduce"]
    assert np.array_equal(first["table"], last["table"])
    assert (first["table_grad"] == 3.0).all() and (last["table_grad"] == 3.0).all()
    assert last["replicated_tag"] == ["word_embeddings.weight"] and first["replicated_tag"] == []


# --- Through the trainer: an untied model at PP 2 saves, resumes and converts exactly ------------------------------

UNTIED_FLAGS = ("--num-layers", "4", "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
                "--ffn-hidden-size", "64", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
                "--no-top-query-layer", "--clip-grad", "0.5")
ITERS, SAVED_AT = 8, 4


@pytest.mark.slow
def test_untied_pp2_resumes_exactly_at_pp2_and_from_universal_at_pp1(tmp_path, tiny_data):
    """Under ZeRO-2, an untied model trained at PP 2 and saved at iteration 4 continues exactly as the uninterrupted
    run from its training checkpoint (PP 2) and from its universal one (PP 1): no stage expects a tied copy."""
    def args(save, pp, *extra):
        return tiny_pretrain_args(tiny_data, str(save), ITERS, *UNTIED_FLAGS, "--pipeline-model-parallel-size",
                                  str(pp), *extra)

    full = tmp_path / "full"
    run_distributed(run_pretrain, world_size=2, pp_size=2, deadline_s=600,
                    argv=args(full, 2, "--save-interval", str(SAVED_AT)))
    at_save = checkpoint_at(full, tmp_path / "at_save", SAVED_AT)
    universal = str(tmp_path / "universal")
    load_tool("convert_checkpoint").main(["--load", at_save, "--to-universal", universal])
    run_distributed(run_pretrain, world_size=2, pp_size=2, deadline_s=600, argv=args(at_save, 2, "--load", at_save))
    run_distributed(run_pretrain, world_size=1, deadline_s=600,
                    argv=args(tmp_path / "pp1", 1, "--load", universal))
    reference = metrics_records(full)
    assert reference[ITERS]["loss"] < reference[1]["loss"]
    for resumed in (metrics_records(at_save), metrics_records(tmp_path / "pp1")):
        assert sorted(resumed) == list(range(SAVED_AT + 1, ITERS + 1))
        for it in resumed:
            for key in ("loss", "grad_norm"):
                assert resumed[it][key] == pytest.approx(reference[it][key], rel=1e-5), (it, key)
