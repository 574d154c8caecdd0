"""RoPE (model/rotary.py, --position-embedding-type rope), fp32, against independent references: the rotation
against Hugging Face's GPT-NeoX rotary embedding (rotary_pct 1.0 and 0.5) and GPT-J's interleaved one, forward and
gradients; our whole model against ``GPTNeoXForCausalLM`` with the weights copied (per-token losses, every weight
gradient); TP 2 (with SP, full and selective recompute) against TP 1 with the top query layer on; what a RoPE model
saves and how the checkpoint tools treat it; and the one-line error of a bad --rotary-percent."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from model_helpers import dense_logits, gather_full, make_batch, max_err, model_plan, tiny_config

from codegeex_train.checkpoint import load_full_state_dict, load_model_checkpoint, save_model_checkpoint
from codegeex_train.checkpoint.files import CheckpointError
from codegeex_train.model.shapes import model_parameter_shapes
from codegeex_train.checkpoint.sharding import split_model_parallel
from codegeex_train.layout.recompute import Recompute
from codegeex_train.model import CodeGeeXModel, ModelConfigError, ModelGroups
from codegeex_train.model.rotary import apply_rotary, rotary_tables
from codegeex_train.layout.stages import stage_layer_ranges
from tests.harness import run_distributed

B, S, HEADS, D = 2, 12, 3, 16
# An offset row and a packed row whose positions restart (--reset-position-ids): the tables come from the ids.
POSITIONS = torch.tensor([list(range(7, 7 + S)), [0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]])
# Packed positions for the model tests (S = 16 of model_helpers): a document of 10 tokens, then one of 6.
MODEL_POSITIONS = torch.stack([torch.arange(16), torch.cat([torch.arange(10), torch.arange(6)])])


def rope_config(**overrides):
    return tiny_config(**{"position_embedding_type": "rope", **overrides})


def _inputs(seed: int = 0):
    """q, k (b, n, s, d) leaves, and upstream gradients for each."""
    g = torch.Generator().manual_seed(seed)
    q, k, dq, dk = (torch.randn(B, HEADS, S, D, generator=g) for _ in range(4))
    return q.requires_grad_(), k.requires_grad_(), dq, dk


def _ours(q, k, rotary_dim, base, interleaved):
    tables = rotary_tables(POSITIONS, rotary_dim, base, torch.float32)

    def rotate(x):  # (b, n, s, d) -> our (b, s, n * d) layout and back
        flat = x.transpose(1, 2).reshape(B, S, HEADS * D)
        return apply_rotary(flat, tables, D, interleaved).view(B, S, HEADS, D).transpose(1, 2)

    return rotate(q), rotate(k)


def _compare(reference, rotary_dim, base, interleaved) -> dict:
    """Max |ours - reference| of the rotated q, k and of their gradients under random upstream gradients."""
    results = []
    for fn in (lambda q, k: _ours(q, k, rotary_dim, base, interleaved), reference):
        q, k, dq, dk = _inputs()
        q_out, k_out = fn(q, k)
        ((q_out * dq).sum() + (k_out * dk).sum()).backward()
        results.append((q_out.detach(), k_out.detach(), q.grad, k.grad, q.detach()))
    (q1, k1, gq1, gk1, q), (q2, k2, gq2, gk2, _) = results
    return {"forward": max(max_err(q1, q2), max_err(k1, k2)), "grad": max(max_err(gq1, gq2), max_err(gk1, gk2)),
            "moved": max_err(q1, q)}  # the rotation did something (a no-op would match only a no-op)


@pytest.mark.parametrize("percent,base", [(1.0, 10000), (0.5, 10000), (0.5, 500)])
def test_rotation_matches_gpt_neox(percent, base):
    from transformers import GPTNeoXConfig
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding, apply_rotary_pos_emb

    hf_config = GPTNeoXConfig(hidden_size=HEADS * D, num_attention_heads=HEADS, rotary_pct=percent,
                              rotary_emb_base=base, max_position_embeddings=32)
    rope = GPTNeoXRotaryEmbedding(hf_config)

    def neox(q, k):  # (b, n, s, d), HF's layout; cos, sin (b, s, rotary dim)
        cos, sin = rope(q, POSITIONS)
        return apply_rotary_pos_emb(q, k, cos, sin)

    diff = _compare(neox, int(D * percent), base, interleaved=False)
    assert diff["moved"] > 0.5
    assert diff["forward"] <= 1e-6 and diff["grad"] <= 1e-6, diff


@pytest.mark.parametrize("percent", [1.0, 0.5])
def test_interleaved_rotation_matches_gpt_j(percent):
    from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb, create_sinusoidal_positions

    rotary_dim = int(D * percent)
    sin, cos = create_sinusoidal_positions(32, rotary_dim)[POSITIONS].split(rotary_dim // 2, dim=-1)

    def gptj(q, k):  # GPT-J rotates (b, s, n, rotary dim) and passes the rest of the head through, as its attention
        def rotate(x):
            x = x.transpose(1, 2)
            rot = apply_rotary_pos_emb(x[..., :rotary_dim], sin, cos)
            return torch.cat([rot, x[..., rotary_dim:]], dim=-1).transpose(1, 2)

        return rotate(q), rotate(k)

    diff = _compare(gptj, rotary_dim, 10000, interleaved=True)
    assert diff["moved"] > 0.5
    assert diff["forward"] <= 1e-6 and diff["grad"] <= 1e-6, diff
    # The two layouts are different rotations: GPT-J's is not GPT-NeoX's.
    assert _compare(gptj, rotary_dim, 10000, interleaved=False)["forward"] > 0.1


# --- The whole model against GPT-NeoX ---------------------------------------------------------------------

def _neox_names(config):
    """Our parameter name -> GPTNeoXForCausalLM's (the word table also feeds HF's untied lm_head)."""
    names = {"word_embeddings.weight": "gpt_neox.embed_in.weight", "final_layernorm.weight":
             "gpt_neox.final_layer_norm.weight", "final_layernorm.bias": "gpt_neox.final_layer_norm.bias"}
    for i in range(config.num_layers):
        for part in ("input_layernorm", "post_attention_layernorm", "attention.query_key_value", "attention.dense",
                     "mlp.dense_h_to_4h", "mlp.dense_4h_to_h"):
            for kind in ("weight", "bias"):
                names[f"layers.{i}.{part}.{kind}"] = f"gpt_neox.layers.{i}.{part}.{kind}"
    return names


def _qkv_to_neox(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Our [Q; K; V] blocks (3h, ...) -> GPT-NeoX's per-head [q_i; k_i; v_i] rows."""
    return t.reshape(3, heads, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def _qkv_from_neox(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t.reshape(heads, 3, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def _neox_comparison(percent: float, base: int) -> dict:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = rope_config(rotary_percent=percent, rotary_base=base, top_query_layer=False, activation="gelu")
    ours = CodeGeeXModel(config, None, None, seed=3)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # LayerNorms and biases start at 1 / 0: perturb everything so that each mapping matters
        for p in ours.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    hf_config = GPTNeoXConfig(
        vocab_size=config.padded_vocab_size, hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads, intermediate_size=config.ffn_hidden_size, hidden_act="gelu",
        rotary_pct=percent, rotary_emb_base=base, max_position_embeddings=config.max_position_embeddings,
        layer_norm_eps=config.layernorm_epsilon, use_parallel_residual=False, hidden_dropout=0.0,
        attention_dropout=0.0, tie_word_embeddings=False, attention_bias=True)
    hf_config._attn_implementation = "eager"  # softmax(q k^T / sqrt(d)) spelled out
    hf = GPTNeoXForCausalLM(hf_config).eval()
    names, heads = _neox_names(config), config.num_attention_heads
    hf_sd = {names[n]: _qkv_to_neox(p.detach(), heads) if "query_key_value" in n else p.detach().clone()
             for n, p in ours.named_parameters()}
    hf_sd["lm_head.weight"] = hf_sd["gpt_neox.embed_in.weight"].clone()
    hf.load_state_dict(hf_sd, strict=True)

    ids, _, labels, weights = make_batch(config)
    loss = ours(ids, MODEL_POSITIONS, labels=labels)  # (b, s)
    logits = hf(input_ids=ids, position_ids=MODEL_POSITIONS).logits  # (b, s, padded v)
    hf_loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view_as(loss)
    ((loss * weights).sum() / weights.sum()).backward()  # the training loss: a weighted mean over tokens
    ((hf_loss * weights).sum() / weights.sum()).backward()
    hf_params = dict(hf.named_parameters())
    grad_errors = {}
    for n, p in ours.named_parameters():
        theirs = hf_params[names[n]].grad
        if n == "word_embeddings.weight":  # the tied table: input embedding + output layer
            theirs = theirs + hf_params["lm_head.weight"].grad
        elif "query_key_value" in n:
            theirs = _qkv_from_neox(theirs, heads)
        grad_errors[n] = max_err(p.grad, theirs)
    return {"loss": max_err(loss, hf_loss), "loss_scale": loss.abs().max().item(), "grads": grad_errors,
            "grad_scale": max(p.grad.abs().max().item() for p in ours.parameters()),
            "checked": len(grad_errors) == len(names)}


@pytest.mark.parametrize("percent,base", [(1.0, 10000), (0.5, 500)])
def test_model_matches_gpt_neox(percent, base):
    """No top query layer, GeLU, dropout 0: our RoPE model is GPT-NeoX with sequential residuals and a tied output
    layer; packed positions restart mid-row (the tables come from the position ids)."""
    r = _neox_comparison(percent, base)
    assert r["checked"] and r["loss_scale"] > 1.0 and r["grad_scale"] > 1e-2
    assert r["loss"] <= 1e-6 * r["loss_scale"], r["loss"]  # losses near 8: one fp32 ulp is 9.5e-7
    assert max(r["grads"].values()) <= 1e-6, r["grads"]


@pytest.mark.parametrize("overrides", [{}, {"rotary_percent": 0.5, "rotary_base": 500},
                                       {"rotary_percent": 0.5, "rotary_interleaved": True}])
@torch.no_grad()
def test_model_with_top_query_layer_matches_dense_reference(overrides):
    """The top query layer under RoPE (its one query row turned by the position, like its keys) and every other
    attention against model_helpers' float64 reference, whose rotation multiplies complex numbers."""
    config = rope_config(**overrides)
    model = CodeGeeXModel(config, None, None, seed=11)
    ids = make_batch(config)[0]
    logits = model(ids, MODEL_POSITIONS)  # (b, s, padded v)
    assert logits.abs().max() > 1.0
    assert max_err(logits, dense_logits(dict(model.named_parameters()), config, ids, MODEL_POSITIONS)) <= 1e-5


# --- TP 2 equals TP 1 ---------------------------------------------------------------------------------------

VARIANTS = {  # name: (config overrides, model keyword arguments)
    "tp": ({}, {}),
    "interleaved_half": ({"rotary_percent": 0.5, "rotary_interleaved": True}, {}),
    "sp_full_recompute": ({}, {"sequence_parallel": True, "recompute": Recompute.full()}),
    "sp_selective": ({"rotary_percent": 0.5}, {"sequence_parallel": True,
                                               "recompute": Recompute("selective", modules=("core_attn",))}),
}


def _tp_parity(topo) -> dict:
    out = {}
    for name, (overrides, kwargs) in VARIANTS.items():
        config = rope_config(**overrides)  # top query layer on
        ids, _, labels, weights = make_batch(config)
        ref = CodeGeeXModel(config, None, None, seed=11)
        model = CodeGeeXModel(config, ModelGroups.from_topology(topo), model_plan(topo, **kwargs), seed=11)
        loss_ref, loss = ref(ids, MODEL_POSITIONS, labels=labels), model(ids, MODEL_POSITIONS, labels=labels)
        ((loss_ref * weights).sum() / weights.sum()).backward()
        ((loss * weights).sum() / weights.sum()).backward()
        grads = gather_full({n: p.grad for n, p in model.named_parameters()}, config, topo.tp_group)
        ref_params = dict(ref.named_parameters())
        out[name] = {"loss": max_err(loss, loss_ref),
                     "grads": max(max_err(grads[n], ref_params[n].grad) for n in grads),
                     "checked": set(grads) == set(ref_params),
                     "top_query_rows": model.top_query_embeddings.weight.shape[0]}
    return out


@pytest.fixture(scope="module")
def tp2():
    return run_distributed(_tp_parity, world_size=2, tp_size=2)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_tp2_equals_tp1(tp2, variant):
    for rank, result in enumerate(tp2):
        r = result[variant]
        assert r["checked"] and r["top_query_rows"] == 1, (rank, r)
        assert r["loss"] <= 1e-5 and r["grads"] <= 1e-6, (rank, r)  # losses near 6: TP sums in another order


def _saved_float_bytes(config) -> int:
    """Bytes of the floating-point storages autograd keeps for backward of one training forward (parameters not
    counted, each storage once)."""
    model = CodeGeeXModel(config, None, None, seed=1)
    ids, _, labels, _ = make_batch(config)
    storages = {}

    def pack(t):
        if t.is_floating_point():
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, MODEL_POSITIONS, labels=labels)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in storages.items() if ptr not in params)


@pytest.mark.parametrize("top_query", [True, False])
def test_rope_keeps_the_activations_of_learned_positions_and_its_tables(top_query):
    """What the accounting may assume: RoPE adds only its (cos, sin) tables, b x s x rotary dim floats per forward,
    to what autograd keeps (the fused QKV output is not kept alive by a view)."""
    for percent in (1.0, 0.5):
        rope = rope_config(top_query_layer=top_query, rotary_percent=percent)
        tables = MODEL_POSITIONS.numel() * rope.rotary_dim * 4  # fp32
        assert _saved_float_bytes(rope) - _saved_float_bytes(tiny_config(top_query_layer=top_query)) == tables


# --- The model's parameters and checkpoints -----------------------------------------------------------------

@pytest.mark.parametrize("top_query", [True, False])
def test_rope_model_has_no_position_table(top_query):
    config = rope_config(top_query_layer=top_query)
    sd = CodeGeeXModel(config, None, None).state_dict()
    assert "position_embeddings.weight" not in sd
    assert ("top_query_embeddings.weight" in sd) == top_query
    if top_query:
        assert sd["top_query_embeddings.weight"].shape == (1, config.hidden_size)
    assert list(model_parameter_shapes(config).items()) == [(n, tuple(t.shape)) for n, t in sd.items()]


def _trained(config) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    fresh = CodeGeeXModel(config, None, None).state_dict()
    return {k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in fresh.items()}


def test_reshard_tool_round_trip(convert, tmp_path):
    """TP 2 x PP 2 -> TP 1 x PP 4 -> TP 1: exact, and each stage file loads strictly into its stage model."""
    config = rope_config(num_layers=4, rotary_percent=0.5)
    full = _trained(config)
    save_model_checkpoint(tmp_path / "2x2", split_model_parallel(full, config, 2, stage_layer_ranges(4, 2)), config, 2,
                          pp_size=2)
    convert.main(["--load", str(tmp_path / "2x2"), "--save", str(tmp_path / "1x4"), "--pipeline-model-parallel-size",
                  "4"])
    convert.main(["--load", str(tmp_path / "1x4"), "--save", str(tmp_path / "1x1")])
    for name in ("1x4", "1x1"):
        loaded, stored, _ = load_full_state_dict(tmp_path / name)
        assert stored == config and list(loaded) == list(full)
        assert all(torch.equal(loaded[k], full[k]) for k in full)
    layers = stage_layer_ranges(4, 4)
    for pp_rank in range(4):
        stage = CodeGeeXModel(config, None, None, pre_process=pp_rank == 0, post_process=pp_rank == 3,
                              layer_numbers=layers[pp_rank])
        load_model_checkpoint(tmp_path / "1x4", stage, pp_size=4, pp_rank=pp_rank)  # strict


@pytest.mark.parametrize("target", ["--to-codegeex"])  # --to-hf exports RoPE models (remote code)
def test_exports_that_need_learned_positions_refuse_in_one_line(convert, tmp_path, target):
    config = rope_config(top_query_layer=target == "--to-codegeex", activation="gelu_tanh")
    save_model_checkpoint(tmp_path / "ckpt", [_trained(config)], config, 1)
    with pytest.raises(SystemExit) as exc:
        convert.main(["--load", str(tmp_path / "ckpt"), target, str(tmp_path / "out")])
    message = exc.value.code
    assert isinstance(message, str) and "\n" not in message and message.startswith("convert_checkpoint.py: error: ")
    assert "rope" in message, message
    assert not (tmp_path / "out").exists()


def test_checkpoints_tell_rope_from_learned(tmp_path):
    """A RoPE checkpoint into a learned model: refused, naming the field; another --rotary-base or
    --max-position-embeddings: loads (no parameter changes), a changed base with a warning; a checkpoint written
    before these fields existed loads as learned_absolute."""
    config = rope_config()
    full = _trained(config)
    save_model_checkpoint(tmp_path / "rope", [full], config, 1)
    with pytest.raises(CheckpointError, match="position_embedding_type rope.*position_embedding_type learned_absolute"):
        load_model_checkpoint(tmp_path / "rope", CodeGeeXModel(tiny_config(), None, None))
    longer = CodeGeeXModel(rope_config(max_position_embeddings=64), None, None)
    load_model_checkpoint(tmp_path / "rope", longer)
    assert torch.equal(longer.state_dict()["top_query_embeddings.weight"], full["top_query_embeddings.weight"])
    with pytest.warns(UserWarning, match="rotary_base=10000"):
        load_model_checkpoint(tmp_path / "rope", CodeGeeXModel(rope_config(rotary_base=500000), None, None))

    learned = tiny_config()
    save_model_checkpoint(tmp_path / "old", [CodeGeeXModel(learned, None, None).state_dict()], learned, 1)
    path = tmp_path / "old" / "iter_0000000" / "mp_rank_00_model_states.pt"
    state = torch.load(path, weights_only=True)
    for field in ("position_embedding_type", "rotary_percent", "rotary_base", "rotary_interleaved"):
        del state["codegeex_train"]["model_config"][field]
    torch.save(state, path)
    _, stored, _ = load_full_state_dict(tmp_path / "old")
    assert stored == learned and not stored.rope
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_model_checkpoint(tmp_path / "old", CodeGeeXModel(learned, None, None))


# --- Bad input ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("percent", [0.4, 0.1])  # head dim 8: int(3.2) = 3 is odd, int(0.8) = 0 rotates nothing
def test_bad_rotary_percent_is_one_line(percent):
    from codegeex_train.config.arguments import ConfigError, parse_args, validate

    with pytest.raises(ModelConfigError) as exc:
        rope_config(rotary_percent=percent).validate()
    line = str(exc.value)
    assert "\n" not in line and line.startswith(f"--rotary-percent {percent} rotates")
    assert re.search(r"channels of each 8-channel head: .* even number >= 2", line), line
    tiny_config(rotary_percent=percent).validate()  # learned positions: the rotary flags do nothing

    args = parse_args(["--data-path", "x", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
                       "--position-embedding-type", "rope", "--rotary-percent", str(percent)])
    with pytest.raises(ConfigError, match=re.escape(f"--rotary-percent {percent} rotates")):
        validate(args, 1, args.model.with_vocab(100))
    out_of_range = parse_args(["--data-path", "x", "--position-embedding-type", "rope", "--rotary-percent", "0"])
    with pytest.raises(ConfigError, match=re.escape("--rotary-percent 0.0 must be in (0, 1]")):
        validate(out_of_range, 1)
