"""The attention options of issue 45 against independent dense references written here, fp32 against float64:
grouped-query attention (n = 8 query heads over g = 4, 2 or 1 key-value groups, query head j on group j // (n/g),
Hugging Face's repeat_kv), RoPE scaling (linear, llama3, yarn: the tables against transformers'
``ROPE_INIT_FUNCTIONS``) and sliding-window attention (an explicit masked softmax), with the bias switches.

One attention layer (``ParallelSelfAttention``) at TP 1 here and TP 2 / TP 4 on gloo ranks, plain, under SP with
selective (core_attn) and full recompute, with document masking: output, input gradient and every weight gradient
(the shards merged back). The whole model (GQA, window, YaRN, the multi-head top query layer) against a dense float64
forward of its own weights, at TP 1, TP 2 with SP and recompute, and CP 2 (ring attention with GQA and the window).
What must fail: TP 4 with 2 groups (the one-line refusal), the reference with the wrong head -> group map, without
the window, without the RoPE scaling (each differs from ours far beyond the tolerance, so the comparison can tell).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from model_helpers import _act, _ln, gather_full, max_err, model_plan, tiny_config

from codegeex_train.checkpoint import partition_spec, split_state_dict
from codegeex_train.context_parallel import gather_from_context_parallel, split_for_context_parallel
from codegeex_train.layout.dims import ParallelDims
from codegeex_train.layout.errors import LayoutError
from codegeex_train.layout.plan import ParallelPlan
from codegeex_train.layout.recompute import Recompute
from codegeex_train.model import CodeGeeXModel, ModelConfig, ModelConfigError, ModelGroups
from codegeex_train.model.attention import ParallelSelfAttention, training_attention_mask
from codegeex_train.model.init import ParamInit
from codegeex_train.model.rotary import RopeScaling, rotary_tables, scaled_inverse_frequencies
from codegeex_train.tensor_parallel import recompute_activations, shard_master_weight
from tests.harness import run_distributed

TOL = 1e-5
B, S, HEADS, HIDDEN = 2, 16, 8, 64  # head dim 8
PREFIX = "layers.0.attention."
DOCS = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 16])  # document ids of a packed row and a plain one
SCALINGS = {  # --rope-scaling and its fields; the llama3 one puts pairs in all three bands, the yarn one on its ramp
    "none": {},
    "linear": {"rope_scaling": "linear", "rope_scaling_factor": 4.0},
    "llama3": {"rope_scaling": "llama3", "rope_scaling_factor": 8.0, "rope_original_max_position_embeddings": 12,
               "rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0},
    "yarn": {"rope_scaling": "yarn", "rope_scaling_factor": 4.0, "rope_original_max_position_embeddings": 12},
}
# Attention cases: key-value groups, scaling, window, document masking, biases
CASES = {
    "g4 yarn": dict(groups=4, scaling="yarn"),
    "g2 llama3 window docs": dict(groups=2, scaling="llama3", window=5, docs=True),
    "g2 linear window, qkv bias only": dict(groups=2, scaling="linear", window=3, qkv_bias_only=True),
    "g1 window": dict(groups=1, scaling="none", window=4),
    "mha window docs": dict(groups=8, scaling="yarn", window=6, docs=True),
}
MODES = {  # name -> (sequence_parallel, recompute)
    "plain": (False, Recompute()),
    "sp + selective core_attn": (True, Recompute("selective", modules=("core_attn",))),
    "sp + full": (True, Recompute("full", "uniform", 1)),
}


def attention_config(groups: int, scaling: str = "none", window: int | None = None, qkv_bias_only: bool = False,
                     **_) -> ModelConfig:
    gqa = {"group_query_attention": True, "num_query_groups": groups} if groups != HEADS else {}
    bias = {"disable_bias_linear": True, "add_qkv_bias": True} if qkv_bias_only else {}
    config = tiny_config(hidden_size=HIDDEN, num_attention_heads=HEADS, position_embedding_type="rope",
                         window_size=window, **gqa, **bias, **SCALINGS[scaling])
    config.check_architecture()
    return config


# --- The independent references ---------------------------------------------------------------------------------

def hf_rope_config(config):
    """transformers' LlamaConfig carrying ``config``'s RoPE (the input of its ROPE_INIT_FUNCTIONS)."""
    from transformers import LlamaConfig

    params = {"rope_type": config.rope_scaling, "rope_theta": float(config.rotary_base),
              "factor": config.rope_scaling_factor, "partial_rotary_factor": config.rotary_percent}
    if config.rope_scaling in ("llama3", "yarn"):
        params["original_max_position_embeddings"] = config.rope_original_max_position_embeddings
    if config.rope_scaling == "llama3":
        params.update(low_freq_factor=config.rope_low_freq_factor, high_freq_factor=config.rope_high_freq_factor)
    if config.rope_scaling == "yarn":
        params.update(beta_fast=config.yarn_beta_fast, beta_slow=config.yarn_beta_slow)
        if config.yarn_attention_factor is not None:
            params["attention_factor"] = config.yarn_attention_factor
    longest = round(config.rope_scaling_factor * (config.rope_original_max_position_embeddings or 16))  # YaRN's check
    return LlamaConfig(hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
                       head_dim=config.head_dim, max_position_embeddings=longest, rope_parameters=params)


def hf_inverse_frequencies(config) -> tuple[torch.Tensor, float]:
    """(theta (r/2,) fp32, the cos / sin factor) as transformers computes them; the plain formula without scaling."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if config.rope_scaling == "none":
        r = config.rotary_dim
        return 1.0 / config.rotary_base ** (torch.arange(0, r, 2, dtype=torch.float64) / r), 1.0
    return ROPE_INIT_FUNCTIONS[config.rope_scaling](hf_rope_config(config), "cpu")


def reference_tables(config, positions: torch.Tensor, ignore_scaling: bool = False):
    """float64 (cos, sin) (b, s, r/2) of transformers' frequencies (``ignore_scaling``: the unscaled ones)."""
    theta, factor = hf_inverse_frequencies(config) if not ignore_scaling else hf_inverse_frequencies(
        tiny_config(hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
                    position_embedding_type="rope"))
    angles = positions[..., None].double() * theta.double()
    return angles.cos() * factor, angles.sin() * factor


def rotate(t: torch.Tensor, tables, heads: int) -> torch.Tensor:
    """(b, s, heads·d) float64, rotate-half RoPE on the first r channels of each head."""
    cos, sin = (x[:, :, None] for x in tables)  # (b, s, 1, r/2)
    b, s, _ = t.shape
    t = t.reshape(b, s, heads, -1)
    half = cos.shape[-1]
    x1, x2, rest = t[..., :half], t[..., half:2 * half], t[..., 2 * half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1).reshape(b, s, -1)


def allowed_pairs(s: int, window: int | None, docs: torch.Tensor | None) -> torch.Tensor:
    """(b | 1, s, s) bool written out: key j <= query i, i - j < window, the same document."""
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    allowed = (j <= i) & ((i - j < window) if window is not None else True)
    allowed = allowed[None]
    if docs is not None:
        allowed = allowed & (docs[:, :, None] == docs[:, None, :])
    return allowed


def dense_core(q, k, v, heads: int, groups: int, allowed, group_of_head=None) -> torch.Tensor:
    """float64 softmax(q k^T / sqrt(d), masked) v: q (b, s, n·d), k, v (b, s, g·d); query head j reads group
    ``group_of_head[j]`` (default j // (n/g): repeat_kv)."""
    b, s, _ = q.shape
    d = q.shape[-1] // heads
    if group_of_head is None:
        group_of_head = torch.arange(heads) // (heads // groups)
    q = q.reshape(b, s, heads, d)
    k, v = (t.reshape(b, s, groups, d)[:, :, group_of_head] for t in (k, v))  # (b, s, n, d)
    scores = torch.einsum("bqnd,bknd->bnqk", q, k) / math.sqrt(d)
    probs = torch.softmax(scores.masked_fill(~allowed[:, None], float("-inf")), dim=-1)
    return torch.einsum("bnqk,bknd->bqnd", probs, v).reshape(b, s, heads * d)


def dense_attention(x, weights: dict, config, tables, allowed, group_of_head=None) -> torch.Tensor:
    """One attention layer in float64 from its full weights (names without the prefix)."""
    n, g, d = config.num_attention_heads, config.kv_groups, config.head_dim
    qkv = x @ weights["query_key_value.weight"].T
    if "query_key_value.bias" in weights:
        qkv = qkv + weights["query_key_value.bias"]
    q, k, v = qkv.split([n * d, g * d, g * d], dim=-1)
    if tables is not None:
        q, k = rotate(q, tables, n), rotate(k, tables, g)
    out = dense_core(q, k, v, n, g, allowed, group_of_head) @ weights["dense.weight"].T
    return out + weights["dense.bias"] if "dense.bias" in weights else out


# --- One attention layer ----------------------------------------------------------------------------------------

def attention_inputs(case: dict):
    g = torch.Generator().manual_seed(1)
    # Scales keep every compared value within a few units: the tolerance is absolute, fp32 rounding relative
    x, dout = 0.5 * torch.randn(B, S, HIDDEN, generator=g), 0.05 * torch.randn(B, S, HIDDEN, generator=g)
    positions = torch.stack([torch.arange(S), torch.arange(S) + 3])  # an offset row: the tables come from the ids
    docs = DOCS if case.get("docs") else None
    return x, dout, positions, docs


def full_biases(config) -> dict[str, torch.Tensor]:
    """Random biases of the layer (zeros at init would leave them untested), the full (TP 1) tensors."""
    g = torch.Generator().manual_seed(2)
    out = {}
    if config.qkv_bias:
        out["query_key_value.bias"] = 0.3 * torch.randn(HIDDEN + 2 * config.kv_size, generator=g)
    if config.linear_bias:
        out["dense.bias"] = 0.3 * torch.randn(HIDDEN, generator=g)
    return out


def build_attention(config, groups: ModelGroups, plan) -> ParallelSelfAttention:
    """The layer at ``groups``' TP size with this rank's shards of the random biases (weights: the TP-independent
    init)."""
    layer = ParallelSelfAttention(config, groups, plan, None, ParamInit(5, 0.2, 1), PREFIX)
    with torch.no_grad():
        for name, full in full_biases(config).items():
            spec = partition_spec(PREFIX + name, config)
            shard = full if spec is None else shard_master_weight(full, spec[0], groups.tp_rank, groups.tp_size,
                                                                  spec[1])
            dict(layer.named_parameters())[name].copy_(shard)
    return layer


def run_attention(layer, config, case: dict, sp: bool, recompute: Recompute, tp_rank: int = 0, tp_size: int = 1):
    """Output, input gradient (whole sequence) and parameter gradients (this rank's shards) of one forward and
    backward; under SP the rank feeds its part of the sequence; full recompute wraps the layer as the model does."""
    x, dout, positions, docs = attention_inputs(case)
    tables = rotary_tables(positions, config.rotary_dim, config.rotary_base, torch.float32, RopeScaling.of(config))
    mask = training_attention_mask(docs, S, config.window_size)
    if sp:
        x, dout = (t.chunk(tp_size, dim=1)[tp_rank] for t in (x, dout))
    x = x.clone().requires_grad_()

    def forward(x_, *mask_, rotary=None):
        return layer(x_, *mask_, rotary=rotary)

    if recompute.is_full:
        out = recompute_activations(lambda *a: forward(*a[:-1], rotary=a[-1]), None, x, *mask, tables)
    else:
        out = forward(x, *mask, rotary=tables)
    out.backward(dout)
    return out.detach(), x.grad, {PREFIX + n: p.grad for n, p in layer.named_parameters()}


def reference_attention(config, case: dict, group_of_head=None, window: bool = True, scaling: bool = True):
    """The dense float64 layer on the TP 1 weights: output, input gradient, parameter gradients by name."""
    layer = build_attention(config, ModelGroups(), model_plan())
    weights = {n: p.detach().double().requires_grad_() for n, p in layer.named_parameters()}
    x, dout, positions, docs = attention_inputs(case)
    x = x.double().requires_grad_()
    allowed = allowed_pairs(S, config.window_size if window else None, docs)
    out = dense_attention(x, weights, config, reference_tables(config, positions, not scaling), allowed,
                          group_of_head)
    out.backward(dout.double())
    return out.detach(), x.grad, {PREFIX + n: w.grad for n, w in weights.items()}


def errors(got, want) -> dict[str, float]:
    out, dx, grads = got
    ref_out, ref_dx, ref_grads = want
    assert sorted(grads) == sorted(ref_grads)
    return {"out": max_err(out, ref_out), "dx": max_err(dx, ref_dx),
            **{name.removeprefix(PREFIX): max_err(grads[name], ref_grads[name]) for name in ref_grads}}


@pytest.mark.parametrize("case", list(CASES))
def test_attention_matches_dense_reference_tp1(case):
    config = attention_config(**CASES[case])
    layer = build_attention(config, ModelGroups(), model_plan())
    names = {n for n, _ in layer.named_parameters()}
    assert ("query_key_value.bias" in names, "dense.bias" in names) == (True, not CASES[case].get("qkv_bias_only"))
    assert layer.query_key_value.weight.shape == (HIDDEN + 2 * config.kv_size, HIDDEN)
    got = run_attention(layer, config, CASES[case], *MODES["plain"])
    err = errors(got, reference_attention(config, CASES[case]))
    assert max(err.values()) <= TOL, err


def test_the_references_can_tell():
    """The comparison above distinguishes what each option changes: the reference with query heads on the wrong
    groups (j mod g instead of j // (n/g)), without the window, without the RoPE scaling, is far from ours."""
    case = CASES["g2 llama3 window docs"]
    config = attention_config(**case)
    got = run_attention(build_attention(config, ModelGroups(), model_plan()), config, case, *MODES["plain"])
    wrong = {"groups": reference_attention(config, case, group_of_head=torch.arange(HEADS) % 2),
             "window": reference_attention(config, case, window=False),
             "scaling": reference_attention(config, case, scaling=False)}
    for what, want in wrong.items():
        err = errors(got, want)
        assert err["out"] > 1e-2 and err["dx"] > 1e-2, (what, err)


def test_a_window_spanning_the_sequence_keeps_the_causal_path():
    assert training_attention_mask(None, S, S) == () and training_attention_mask(None, S, S - 1) != ()
    assert torch.equal(training_attention_mask(DOCS, S, 100)[0], training_attention_mask(DOCS, S, None)[0])


def test_tp_beyond_the_groups_is_refused_in_one_line():
    config = attention_config(groups=2)
    with pytest.raises(ModelConfigError, match=r"--num-query-groups 2 is not divisible by "
                                               r"--tensor-model-parallel-size 4: .* largest TP size .* is 2") as e:
        config.validate(4)
    assert "\n" not in str(e.value)
    config.validate(2)
    with pytest.raises(LayoutError, match="largest TP size for 2 groups here is 2"):
        ParallelPlan.derive(ParallelDims(4, 4), micro_batch_size=1, num_attention_heads=HEADS, num_query_groups=2)


# --- RoPE scaling: the tables ------------------------------------------------------------------------------------

@pytest.mark.parametrize("scaling", ["linear", "llama3", "yarn", "yarn attention factor", "llama3 partial"])
def test_rope_scaling_tables_match_transformers(scaling):
    overrides = dict(SCALINGS[scaling.split()[0]], hidden_size=64, num_attention_heads=2)  # head dim 32
    if scaling == "yarn attention factor":
        overrides.update(yarn_attention_factor=1.3, yarn_beta_fast=16.0, yarn_beta_slow=2.0)
    if scaling == "llama3 partial":
        overrides.update(rotary_percent=0.5)
    config = tiny_config(position_embedding_type="rope", **overrides)
    theta, factor = hf_inverse_frequencies(config)
    ours = scaled_inverse_frequencies(config.rotary_dim, config.rotary_base, RopeScaling.of(config))
    assert ours.dtype == theta.dtype == torch.float32 and torch.equal(ours, theta)
    assert RopeScaling.of(config).cos_sin_factor == factor
    positions = torch.stack([torch.arange(40), torch.arange(40) + 100])
    tables = rotary_tables(positions, config.rotary_dim, config.rotary_base, torch.float32, RopeScaling.of(config))
    angles = positions[..., None].float() * theta  # transformers' fp32 tables
    want = torch.stack([angles.cos() * factor, angles.sin() * factor]).unsqueeze(-2)
    assert tables.shape == want.shape and max_err(tables, want) <= 1e-6
    plain = rotary_tables(positions, config.rotary_dim, config.rotary_base, torch.float32)
    assert max_err(plain, want) > 1e-2  # the scaling changes the tables: ignoring it fails the comparison


def test_no_scaling_is_todays_table():
    config = tiny_config(position_embedding_type="rope")
    assert RopeScaling.of(config) is None
    positions = torch.arange(12)[None]
    assert torch.equal(rotary_tables(positions, 8, 10000, torch.float32, None),
                       rotary_tables(positions, 8, 10000, torch.float32))


# --- The whole model --------------------------------------------------------------------------------------------

def model_config(groups: int = 2, **overrides):
    """GQA (8 heads, 2 groups; 8: multi-head), a window of 5 over 16 tokens, YaRN, the multi-head top query layer."""
    gqa = {"group_query_attention": True, "num_query_groups": groups} if groups != HEADS else {}
    fields = dict(hidden_size=HIDDEN, num_attention_heads=HEADS, position_embedding_type="rope", window_size=5,
                  init_method_std=0.1, **gqa, **SCALINGS["yarn"])
    config = tiny_config(**{**fields, **overrides})
    config.check_architecture()
    return config


def perturbed_state(config) -> dict[str, torch.Tensor]:
    """The TP 1 model's state with every parameter perturbed (norms and zero biases would hide mappings)."""
    model = CodeGeeXModel(config, None, None, seed=11)
    g = torch.Generator().manual_seed(4)
    return {n: p.detach() + 0.05 * torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}


def model_batch(config):
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(0, config.vocab_size, (B, S), generator=g)
    labels = torch.randint(0, config.vocab_size, (B, S), generator=g)
    return ids, torch.arange(S).expand(B, S), labels


def dense_model_logits(sd: dict, config, ids, positions) -> torch.Tensor:
    """float64 logits (b, s, padded v) of the model's maths: LayerNorm, GQA attention with the window and scaled RoPE,
    the MLP, the top query layer (multi-head, its one query row rotated by the position), the tied output."""
    sd = {k: v.double() for k, v in sd.items()}
    eps, n, h = config.layernorm_epsilon, config.num_attention_heads, config.hidden_size
    tables = reference_tables(config, positions)
    allowed = allowed_pairs(ids.shape[1], config.window_size, None)

    def ln(x, p):
        return _ln(x, sd[p + ".weight"], sd[p + ".bias"], eps)

    def mlp(x, p):
        inner = _act(x @ sd[p + "mlp.dense_h_to_4h.weight"].T + sd[p + "mlp.dense_h_to_4h.bias"], config.activation)
        return inner @ sd[p + "mlp.dense_4h_to_h.weight"].T + sd[p + "mlp.dense_4h_to_h.bias"]

    x = sd["word_embeddings.weight"][ids]
    for i in range(config.num_layers):
        p = f"layers.{i}."
        weights = {k.removeprefix(p + "attention."): v for k, v in sd.items() if k.startswith(p + "attention.")}
        x = x + dense_attention(ln(x, p + "input_layernorm"), weights, config, tables, allowed)
        x = x + mlp(ln(x, p + "post_attention_layernorm"), p)
    x = ln(x, "final_layernorm")
    p = "top_query_layer."
    a = ln(x, p + "input_layernorm")
    query = sd["top_query_embeddings.weight"][torch.zeros_like(positions)]
    q = rotate(query @ sd[p + "attention.query.weight"].T + sd[p + "attention.query.bias"], tables, n)
    k, v = (a @ sd[p + "attention.key_value.weight"].T + sd[p + "attention.key_value.bias"]).split(h, dim=-1)
    ctx = dense_core(q, rotate(k, tables, n), v, n, n, allowed)
    y = x + ctx @ sd[p + "attention.dense.weight"].T + sd[p + "attention.dense.bias"]
    x = y + mlp(ln(y, p + "post_attention_layernorm"), p)
    return x @ sd["word_embeddings.weight"].T


def reference_model(config, ids, positions, labels):
    """Dense logits and the gradients of the mean per-token loss, float64."""
    sd = {n: t.double().requires_grad_() for n, t in perturbed_state(config).items()}
    logits = dense_model_logits(sd, config, ids, positions)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="mean")
    loss.backward()
    return logits.detach(), {n: t.grad for n, t in sd.items()}


def test_model_matches_dense_reference_tp1():
    config = model_config()
    ids, positions, labels = model_batch(config)
    model = CodeGeeXModel(config, None, None, seed=11)
    model.load_state_dict(perturbed_state(config))
    logits = model(ids, positions, gather_logits=True)
    model(ids, positions, labels=labels).mean().backward()
    want_logits, want_grads = reference_model(config, ids, positions, labels)
    assert max_err(logits, want_logits) <= TOL
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert sorted(grads) == sorted(want_grads)
    assert max(max_err(grads[n], want_grads[n]) for n in grads) <= TOL
    # the window matters here: the same model without it is far off
    plain = CodeGeeXModel(model_config(window_size=None), None, None, seed=11)
    plain.load_state_dict(perturbed_state(config))
    assert max_err(plain(ids, positions, gather_logits=True), want_logits) > 1e-2


# --- TP 2 / TP 4 and CP 2 on gloo ranks -----------------------------------------------------------------------

def _gathered_sequence(t: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def tp_suite(topology) -> dict:
    """Every attention case the TP size allows in every mode, and (TP 2) the whole model with SP and recompute."""
    groups, tp = ModelGroups.from_topology(topology), topology.tp_size
    out = {}
    for name, case in CASES.items():
        if case["groups"] % tp:
            continue
        config = attention_config(**case)
        for mode, (sp, recompute) in MODES.items():
            layer = build_attention(config, groups, model_plan(topology, sequence_parallel=sp, recompute=recompute))
            y, dx, grads = run_attention(layer, config, case, sp, recompute, topology.tp_rank, tp)
            if sp:
                y, dx = (_gathered_sequence(t, topology.tp_group) for t in (y, dx))
            out[f"{name} | {mode}"] = {"out": y, "dx": dx, **gather_full(grads, config, topology.tp_group)}
    if tp == 2:
        config = model_config()
        ids, positions, labels = model_batch(config)
        for mode, (sp, recompute) in MODES.items():
            model = CodeGeeXModel(config, groups, model_plan(topology, sequence_parallel=sp, recompute=recompute),
                                  seed=11)
            model.load_state_dict(split_state_dict(perturbed_state(config), config, tp)[topology.tp_rank])
            model(ids, positions, labels=labels).mean().backward()
            with torch.no_grad():
                logits = model(ids, positions, gather_logits=True)
            out[f"model | {mode}"] = {"logits": logits, **gather_full({n: p.grad for n, p in model.named_parameters()},
                                                                       config, topology.tp_group)}
    return out


def cp_suite(topology) -> dict:
    """The whole model at CP 2 (ring attention with GQA and the window), with and without selective recompute:
    this rank's logits and the parameter gradients summed over CP."""
    cp, rank = topology.cp_size, dist.get_rank(topology.cp_group)
    out = {}
    for groups_count in (2, HEADS):  # GQA and multi-head
        config = model_config(groups_count)
        ids, positions, labels = (split_for_context_parallel(t, 1, rank, cp) for t in model_batch(config))
        for recompute in (Recompute(), Recompute("selective", modules=("core_attn",))):
            plan = model_plan(topology, recompute=recompute)
            model = CodeGeeXModel(config, ModelGroups.from_topology(topology), plan, seed=11)
            model.load_state_dict(perturbed_state(config))
            (model(ids, positions, labels=labels).sum() / (B * S)).backward()  # this rank's share of the mean
            grads = {n: p.grad for n, p in model.named_parameters()}
            for g in grads.values():
                dist.all_reduce(g, group=topology.cp_group)
            with torch.no_grad():
                logits = model(ids, positions, gather_logits=True)
            out[f"groups {groups_count} | {recompute.granularity}"] = {"logits": logits, **grads}
    return out


@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)], ids=lambda n: f"tp{n}")
def tp_ranks(request):
    return request.param, run_distributed(tp_suite, world_size=request.param, tp_size=request.param, deadline_s=400)


def test_attention_matches_dense_reference_at_tp(tp_ranks):
    tp, ranks = tp_ranks
    checked = 0
    for name, case in CASES.items():
        if case["groups"] % tp:
            continue
        config = attention_config(**case)
        want = reference_attention(config, case)
        for mode in MODES:
            result = {k: torch.from_numpy(v) for k, v in ranks[0][f"{name} | {mode}"].items()}
            got = (result.pop("out"), result.pop("dx"), result)
            err = errors(got, want)
            assert max(err.values()) <= TOL, (tp, name, mode, err)
            checked += 1
    assert checked == len(MODES) * {2: 4, 4: 2}[tp]  # the cases whose groups the TP size divides


@pytest.mark.parametrize("tp_ranks", [2], indirect=True, ids=["tp2"])
def test_model_matches_dense_reference_at_tp2(tp_ranks):
    _, ranks = tp_ranks
    config = model_config()
    want_logits, want_grads = reference_model(config, *model_batch(config))
    for mode in MODES:
        for rank in ranks:
            result = {k: torch.from_numpy(v) for k, v in rank[f"model | {mode}"].items()}
            assert max_err(result.pop("logits"), want_logits) <= TOL, mode
            assert sorted(result) == sorted(want_grads)
            assert max(max_err(result[n], want_grads[n]) for n in result) <= TOL, mode


@pytest.mark.slow
def test_model_matches_dense_reference_at_cp2():
    ranks = run_distributed(cp_suite, world_size=2, cp_size=2, deadline_s=300)
    for groups_count in (2, HEADS):
        config = model_config(groups_count)
        want_logits, want_grads = reference_model(config, *model_batch(config))
        for granularity in (None, "selective"):
            key = f"groups {groups_count} | {granularity}"
            logits = gather_from_context_parallel([torch.from_numpy(r[key]["logits"]) for r in ranks], dim=1)
            assert max_err(logits, want_logits) <= TOL, key
            grads = {n: torch.from_numpy(v) for n, v in ranks[0][key].items() if n != "logits"}
            assert sorted(grads) == sorted(want_grads)
            assert max(max_err(grads[n], want_grads[n]) for n in grads) <= TOL, key
