"""The accounting of the Hugging Face families' options (grouped-query attention, SwiGLU, RMSNorm, the untied output
layer, the bias switches, the sliding window): parameters per rank against the checkpoint's shapes and a real model,
the FLOP count against a hand count and Megatron's form, and, on 2 gloo ranks, what autograd saves and the bytes TP
moves against the theory (as test_comm_accounting.py does for CodeGeeX's shape). The CLI runs are in
test_model_family_runs.py."""

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from codegeex_train.accounting import CommCounter
from codegeex_train.accounting.memory import SavedActivations
from codegeex_train.accounting.theory import (
    Workload,
    activation_bytes_per_microbatch,
    comm_bytes_per_step,
    largest_parameter,
    layer_activation_bytes,
    stage_parameters,
    tp_bytes_per_microbatch,
)
from codegeex_train.checkpoint.files import rank_parameter_shapes
from codegeex_train.model.shapes import model_parameter_shapes
from codegeex_train.config.model_config import ModelConfig
from codegeex_train.layout.dims import ParallelDims
from codegeex_train.layout.plan import ParallelPlan
from codegeex_train.layout.recompute import Recompute
from codegeex_train.model import CodeGeeXModel, ModelGroups
from codegeex_train.model.flops import model_flops_per_iteration
from codegeex_train.tensor_parallel import model_parallel_seed
from tests.harness import run_distributed

# A Qwen2-shaped model (GQA, SwiGLU, RMSNorm, untied, QKV bias only) and its variants; 8 heads in 2 groups: TP 2.
B, S, H, HEADS, GROUPS, FFN, VOCAB = 2, 32, 32, 4, 2, 48, 256
QWEN2 = dict(num_layers=2, hidden_size=H, num_attention_heads=HEADS, ffn_hidden_size=FFN, max_position_embeddings=S,
             vocab_size=VOCAB, make_vocab_size_divisible_by=64, position_embedding_type="rope",
             normalization="RMSNorm", swiglu=True, group_query_attention=True, num_query_groups=GROUPS,
             untie_embeddings_and_output_weights=True, disable_bias_linear=True, add_qkv_bias=True,
             top_query_layer=False, hidden_dropout=0.0, attention_dropout=0.0)
LLAMA = {**QWEN2, "add_qkv_bias": False, "untie_embeddings_and_output_weights": False}  # tied, no bias at all
STARCODER2 = {**QWEN2, "normalization": "LayerNorm", "swiglu": False, "activation": "gelu_tanh",
              "disable_bias_linear": False, "add_qkv_bias": False, "window_size": 8}
CODEGEEX_GQA = {**QWEN2, "top_query_layer": True}  # the top query layer stays multi-head beside GQA layers
SHAPES = {"qwen2": QWEN2, "llama tied": LLAMA, "starcoder2": STARCODER2, "gqa + top query layer": CODEGEEX_GQA}


def _config(shape=QWEN2, **overrides) -> ModelConfig:
    config = ModelConfig(**{**shape, **overrides})
    config.check_architecture()
    return config


def _plan(tp=1, pp=1, layers=QWEN2["num_layers"], **kw) -> ParallelPlan:
    return ParallelPlan.derive(ParallelDims(tp * pp, tp, pp), micro_batch_size=B, num_layers=layers, seq_length=S, **kw)


def _numel(shapes) -> int:
    return sum(torch.Size(s).numel() for s in shapes.values())


# --- parameters -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", SHAPES)
@pytest.mark.parametrize("tp,pp,layers", [(1, 1, 2), (2, 1, 2), (2, 2, 2), (1, 3, 3), (2, 2, 6)])
def test_parameters_per_rank_equal_the_checkpoint_shapes(name, tp, pp, layers):
    """``stage_parameters`` (what ZeRO partitions, what the planner ranks) is the sum of the shapes a rank's model
    file holds (checkpoint/files.py ``rank_parameter_shapes``, built from ``model_parameter_shapes``), and
    ``largest_parameter`` its largest; for every family's options, at TP 1 and 2 and PP 1 to 3."""
    config = _config(SHAPES[name], num_layers=layers)
    w = Workload(config, _plan(tp, pp, layers))
    for pp_rank in range(pp):
        shapes = rank_parameter_shapes(config, tp, w.plan.stage_layers, pp_rank)
        assert stage_parameters(w, pp_rank) == _numel(shapes), (name, tp, pp, pp_rank)
        assert largest_parameter(w, pp_rank) == max(torch.Size(s).numel() for s in shapes.values())
    if tp == pp == 1:
        assert stage_parameters(w, 0) == _numel(model_parameter_shapes(config))


def test_untied_output_layer_and_gqa_counted_by_hand():
    """The shapes by hand: a Qwen2 layer holds 2 RMSNorm weights, [Q; K; V] of (h + 2 g d) rows with its bias, the
    dense h x h without bias, [gate; up] 2 ffn x h and down h x ffn; the untied model holds both tables."""
    config = _config()
    kv = GROUPS * (H // HEADS)  # 16
    layer = 2 * H + (H + 2 * kv) * H + (H + 2 * kv) + H * H + 2 * FFN * H + FFN * H
    tables = 2 * 256 * H  # word table and output layer, 256 rows (250 would pad to 256 too)
    w = Workload(config, _plan())
    assert stage_parameters(w, 0) == 2 * layer + H + tables  # + the final RMSNorm
    tied = Workload(_config(untie_embeddings_and_output_weights=False), _plan())
    assert stage_parameters(w, 0) - stage_parameters(tied, 0) == 256 * H  # the output layer's own table
    # PP 2: tied, both ends hold the word table; untied, the first the table and the last the output layer
    for cfg in (config, tied.model):
        piped = Workload(cfg, _plan(pp=2))
        assert [stage_parameters(piped, i) for i in (0, 1)] == [layer + 256 * H, layer + H + 256 * H]


def _stage_numel(config, tp, pp_rank, layers, monkeypatch):
    """Parameters of one rank of one stage, counted on a real CodeGeeXModel (meta device; TP faked as rank 1)."""
    group = None
    if tp > 1:
        group = object()
        monkeypatch.setattr(dist, "get_world_size", lambda g=None: tp)
        monkeypatch.setattr(dist, "get_rank", lambda g=None: 1)
    model = CodeGeeXModel(config, ModelGroups(tp=group), pre_process=pp_rank == 0,
                          post_process=pp_rank == len(layers) - 1, layer_numbers=layers[pp_rank], device="meta")
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", SHAPES)
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2)])
def test_parameters_per_rank_equal_a_real_model(name, tp, pp, monkeypatch):
    config = _config(SHAPES[name])
    w = Workload(config, _plan(tp, pp))
    for pp_rank in range(pp):
        assert stage_parameters(w, pp_rank) == _stage_numel(config, tp, pp_rank, w.plan.stage_layers, monkeypatch)


# --- FLOPs ------------------------------------------------------------------------------------------------------

def test_flops_of_gqa_and_swiglu_match_a_hand_count():
    config = _config(vocab_size=100)  # padded to 128
    b, s, kv = 2, 16, GROUPS * (H // HEADS)
    qkv = 2 * (b * s) * H * (H + 2 * kv)  # queries h, keys and values g d each
    scores = 2 * b * s * s * H
    attn_v = 2 * b * s * s * H
    attn_out = 2 * (b * s) * H * H
    mlp = 3 * 2 * (b * s) * H * FFN  # gate, up, down
    layer = qkv + scores + attn_v + attn_out + mlp
    assert layer == 131072 + 32768 + 32768 + 65536 + 294912
    logits = 2 * (b * s) * H * 128
    assert model_flops_per_iteration(config, b, s) == 3 * (2 * layer + logits)
    assert model_flops_per_iteration(config, b, s, checkpoint_activations=True) == 3 * (2 * layer + logits) + 2 * layer
    # Megatron-LM's form: 12 b s L h^2 (1 + g/n + s/h) + 12 b s L h f (3/2 gated) + 6 b s h V (integer-exact here)
    megatron = (12 * b * s * 2 * H * H * (1 + GROUPS / HEADS + s / H) + 12 * b * s * 2 * H * FFN * 3 / 2
                + 6 * b * s * H * 128)
    assert model_flops_per_iteration(config, b, s) == megatron
    # norms, biases and the output layer's tying change no matmul; the top query layer stays multi-head
    for other in (dict(normalization="LayerNorm"), dict(disable_bias_linear=False, add_qkv_bias=False),
                  dict(untie_embeddings_and_output_weights=False)):
        assert model_flops_per_iteration(_config(vocab_size=100, **other), b, s) == 3 * (2 * layer + logits)
    top = _config(vocab_size=100, top_query_layer=True)
    mha_layer = layer + 2 * (b * s) * H * 2 * (H - kv)
    assert model_flops_per_iteration(top, b, s) == 3 * (2 * layer + mha_layer + logits)


# --- communication ----------------------------------------------------------------------------------------------

def test_untied_model_has_no_embedding_traffic():
    """Tied, the two ends of the pipeline all-reduce the word table's gradient (the "embedding" group) and ZeRO
    all-reduces the tied copy once more; untied, the output layer is the last stage's own parameter: neither."""
    table = 256 // 2 * H * 4  # this TP rank's rows of the word table, fp32 gradient
    for tied, embedding in ((True, 2 * table), (False, 0)):
        config = _config(untie_embeddings_and_output_weights=not tied)
        w = Workload(config, ParallelPlan.derive(ParallelDims(8, 2, 2), micro_batch_size=B, num_microbatches=2,
                                                 num_layers=2, seq_length=S))
        for pp_rank in (0, 1):
            comm = comm_bytes_per_step(w, pp_rank)
            assert comm["embedding"] == embedding, (tied, pp_rank)
            zero = 2 * 2 * stage_parameters(w, pp_rank) * 4 + stage_parameters(w, pp_rank) * 4
            assert comm["dp"] == zero + (embedding if tied else 0), (tied, pp_rank)


def count_tp_bytes(topo, cases):
    """Bytes moved per micro-batch (forward and backward) of each case's model on this TP group, with the theory's."""
    out = {}
    for name, (shape, sp, recompute) in cases.items():
        config = _config(shape)
        plan = _plan(tp=topo.tp_size, layers=config.num_layers, sequence_parallel=sp, recompute=recompute)
        tracker = model_parallel_seed(5, topo.tp_rank)
        model = CodeGeeXModel(config, ModelGroups.from_topology(topo), plan, tracker, seed=5).train()
        ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(1))
        with CommCounter(topo.named_groups()) as comm:
            model(ids, torch.arange(S).repeat(B, 1), labels=ids).mean().backward()
        out[name] = comm.take(), tp_bytes_per_microbatch(Workload(config, plan))
    return out


TP_CASES = {"qwen2": (QWEN2, False, Recompute()), "qwen2 + SP": (QWEN2, True, Recompute()),
            "qwen2 + SP + full": (QWEN2, True, Recompute.full()),
            "starcoder2 + SP + selective": (STARCODER2, True, Recompute("selective")),
            "gqa + top query layer + SP + full": (CODEGEEX_GQA, True, Recompute.full())}


@pytest.mark.slow
def test_tp_bytes_equal_the_theory_for_the_families():
    """TP all-reduces are unchanged in count by GQA (the QKV output stays rank-local), SwiGLU (the [gate; up] output
    too) and the untied output layer (its f is the tied table's): measured equal to the theory to the byte."""
    for name, (measured, terms) in run_distributed(count_tp_bytes, world_size=2, tp_size=2, cases=TP_CASES)[0].items():
        assert measured == {"tp": sum(terms.values())}, name


# --- saved activations ------------------------------------------------------------------------------------------

DEPTHS = (1, 3)
# name -> (shape overrides, SP, recompute, dropout); all at TP 2 on the 2 ranks
ACTIVATION_CASES = {
    "qwen2": (QWEN2, False, Recompute(), 0.0),
    "qwen2 + SP": (QWEN2, True, Recompute(), 0.0),
    "qwen2 + SP + selective": (QWEN2, True, Recompute("selective"), 0.0),
    "qwen2 + SP + full": (QWEN2, True, Recompute.full(), 0.0),
    "qwen2, dropout (math path)": (QWEN2, False, Recompute(), 0.1),
    "starcoder2 (window)": (STARCODER2, False, Recompute(), 0.0),
    "starcoder2 (window) + SP + selective": (STARCODER2, True, Recompute("selective"), 0.1),
    "gqa + top query layer + SP": (CODEGEEX_GQA, True, Recompute(), 0.0),
}


def _case_config(name, layers):
    shape, _, _, dropout = ACTIVATION_CASES[name]
    return _config(shape, num_layers=layers, hidden_dropout=dropout, attention_dropout=dropout)


def _case_plan(name, layers):
    _, sp, recompute, _ = ACTIVATION_CASES[name]
    return _plan(tp=2, layers=layers, sequence_parallel=sp, recompute=recompute)


def measure_saved(topo, names):
    out = {}
    for name in names:
        for layers in DEPTHS:
            tracker = model_parallel_seed(5, topo.tp_rank)
            model = CodeGeeXModel(_case_config(name, layers), ModelGroups.from_topology(topo),
                                  _case_plan(name, layers), tracker, seed=5).train()
            ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(1))
            with SavedActivations(model) as saved:
                loss = model(ids, torch.arange(S).repeat(B, 1), labels=ids)
            loss.mean().backward()
            out[name, layers] = saved.bytes
    return out


@pytest.fixture(scope="module")
def saved_activations():
    return run_distributed(measure_saved, world_size=2, tp_size=2, names=list(ACTIVATION_CASES))[0]


def _theory(name, layers):
    return activation_bytes_per_microbatch(Workload(_case_config(name, layers), _case_plan(name, layers),
                                                    device="cpu"))


@pytest.mark.slow
@pytest.mark.parametrize("name", ACTIVATION_CASES)
def test_saved_activations_equal_theory_for_the_families(saved_activations, name):
    """What autograd keeps per micro-batch on a TP rank equals ``theory.activation_parts`` (the tolerance of
    test_comm_accounting.py; equal to the byte on torch 2.13's CPU), and so does the per-layer difference between 3
    layers and 1: the term GQA's groups, SwiGLU's [gate; up] and product, RMSNorm's one statistic and the window's
    repeated K/V and additive mask are in."""
    for layers in DEPTHS:
        assert saved_activations[name, layers] == pytest.approx(_theory(name, layers), rel=0.05), (name, layers)
    measured = saved_activations[name, 3] - saved_activations[name, 1]
    assert measured == pytest.approx(_theory(name, 3) - _theory(name, 1), rel=0.01), name


def test_gqa_swiglu_rmsnorm_terms_per_layer():
    """The per-layer terms the options change, at TP 2 (fp32, CPU: fused attention without dropout): K and V of g
    groups (h + 2 g d channels instead of 3h), SwiGLU's [gate; up] input (2 ffn) and product (ffn), RMSNorm's one
    fp32 statistic per token and norm (LayerNorm: two)."""
    w = Workload(_config(), _plan(tp=2), device="cpu")
    parts = layer_activation_bytes(w)
    kv = GROUPS * (H // HEADS)
    assert parts["qkv"] == 4 * B * S * (H + 2 * kv) // 2
    assert parts["mlp_activation_input"] == 4 * B * S * 2 * FFN // 2
    assert parts["mlp_activation_output"] == 4 * B * S * FFN // 2
    assert parts["layernorm_statistics"] == 2 * 4 * B * S
    layernorm = layer_activation_bytes(replace(w, model=_config(normalization="LayerNorm")))
    assert layernorm["layernorm_statistics"] == 2 * 2 * 4 * B * S
    # the window: K/V repeated to the heads behind the mask, and SDPA's additive copy of the band (e s^2)
    windowed = layer_activation_bytes(replace(w, model=_config(window_size=8)))
    assert windowed["attention_core"] - parts["attention_core"] == 2 * 4 * B * S * (H - kv) // 2 + 4 * S * S


@pytest.mark.parametrize("name,recompute", [(name, Recompute()) for name in SHAPES]
                         + [("starcoder2", Recompute("selective")), ("qwen2", Recompute.full())],
                         ids=lambda v: v.describe() if isinstance(v, Recompute) else v)
def test_saved_activations_equal_theory_on_one_rank(name, recompute):
    """The same on one rank, no process group (fast): equal to the byte for each family's shape (and, under
    recompute, the window's band kept once as the recomputed attentions' input)."""
    for layers in DEPTHS:
        config = _config(SHAPES[name], num_layers=layers)
        plan = _plan(layers=layers, recompute=recompute)
        model = CodeGeeXModel(config, None, plan, seed=5).train()
        ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(1))
        with SavedActivations(model) as saved:
            loss = model(ids, torch.arange(S).repeat(B, 1), labels=ids)
        loss.mean().backward()
        assert saved.bytes == activation_bytes_per_microbatch(Workload(config, plan, device="cpu")), (name, layers)
