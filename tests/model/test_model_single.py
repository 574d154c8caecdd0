"""Single-process model tests: dense reference, counts, FLOPs, config errors, sharding, pipeline stages,
the Hugging Face GPT-2 converter and the checkpoint layout."""

from __future__ import annotations

import pytest
import torch
from model_helpers import B, S, dense_logits, hf_batch, make_batch, max_err, tiny_config

from codegeex_train.checkpoint import (
    CheckpointError,
    load_full_state_dict,
    load_model_checkpoint,
    load_model_shard,
    merge_state_dicts,
    partition_spec,
    read_latest,
    save_model_checkpoint,
    split_state_dict,
)
from codegeex_train.checkpoint import files as checkpoint_module
from codegeex_train.formats.huggingface.gpt2 import full_to_hf_gpt2, hf_gpt2_to_full
from codegeex_train.model import (
    CodeGeeXModel,
    ModelConfigError,
    count_parameters,
    model_flops_per_iteration,
    model_summary,
)


@pytest.mark.parametrize("top_query", [True, False])
def test_model_matches_dense_reference(top_query):
    config = tiny_config(top_query_layer=top_query)
    ids, pos, _, _ = make_batch(config)
    model = CodeGeeXModel(config, None, None, seed=5)
    logits = model(ids, pos, gather_logits=True)
    expected = dense_logits(dict(model.named_parameters()), config, ids, pos)
    assert logits.abs().max() > 1.0  # logits far from zero, so the comparison means something
    assert max_err(logits, expected) <= 1e-5


@pytest.mark.parametrize("activation,top_query", [("fast_gelu", True), ("gelu_tanh", False), ("gelu", True)])
def test_model_gradients_match_dense_reference(activation, top_query):
    """The weighted training loss's gradient of every parameter against autograd through the independent float64
    reference (the hand-written backwards: fast GeLU, vocab-parallel cross-entropy, ...)."""
    config = tiny_config(activation=activation, top_query_layer=top_query)
    ids, pos, labels, weights = make_batch(config)
    model = CodeGeeXModel(config, None, None, seed=5)
    ((model(ids, pos, labels=labels) * weights).sum() / weights.sum()).backward()

    dense = {n: p.detach().double().requires_grad_() for n, p in model.named_parameters()}
    logits = dense_logits(dense, config, ids, pos)
    per_token = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
    ((per_token.view(B, S) * weights).sum() / weights.sum()).backward()
    for n, p in model.named_parameters():
        scale = dense[n].grad.abs().max().item()
        assert scale > 0, n  # every parameter gets a gradient, so the comparison means something
        assert max_err(p.grad, dense[n].grad) <= 1e-5 * max(1.0, scale), n


def test_seed_changes_every_weight_and_repeats_exactly():
    """--seed reaches the initialisation: another seed draws other numbers for every weight, the same seed the same
    ones (LayerNorm starts at 1 and 0 and biases at 0 whatever the seed, so those are left out)."""
    config = tiny_config()
    a, again, b = (CodeGeeXModel(config, None, None, seed=s).state_dict() for s in (7, 7, 8))
    drawn = [n for n, t in a.items() if t.float().std() > 0]
    assert len(drawn) >= 10
    assert all(torch.equal(a[n], again[n]) for n in a)
    assert not any(torch.equal(a[n], b[n]) for n in drawn), [n for n in drawn if torch.equal(a[n], b[n])]


def test_top_query_reads_queries_by_position():
    """Shifting the query table by one position changes the logits: queries come from positions."""
    config = tiny_config()
    ids, pos, _, _ = make_batch(config)
    model = CodeGeeXModel(config, None, None, seed=5)
    before = model(ids, pos)
    with torch.no_grad():
        model.top_query_embeddings.weight.copy_(model.top_query_embeddings.weight.roll(1, 0))
    assert max_err(model(ids, pos), before) > 1e-2


@pytest.mark.parametrize("top_query", [True, False])
def test_count_parameters_and_summary(top_query):
    config = tiny_config(top_query_layer=top_query)
    model = CodeGeeXModel(config, None, None)
    numel = sum(p.numel() for p in model.parameters())
    assert count_parameters(config) == numel
    text = model_summary(model, config, tp_size=1)
    assert f"{numel:,} total" in text and f"float32 {numel * 4 / 1024:.1f} KiB" in text


def test_flops_match_hand_count():
    config = tiny_config(num_layers=2, hidden_size=32, ffn_hidden_size=128, vocab_size=100)  # padded 128
    b, s = 2, 16
    qkv = 2 * (b * s) * 32 * (3 * 32)  # 196608
    scores = 2 * b * s * s * 32  # 32768
    attn_v = 2 * b * s * s * 32  # 32768
    attn_out = 2 * (b * s) * 32 * 32  # 65536
    mlp = 2 * (b * s) * 32 * 128 + 2 * (b * s) * 128 * 32  # 524288
    layer = qkv + scores + attn_v + attn_out + mlp  # 851968
    logits = 2 * (b * s) * 32 * 128  # 262144
    forward = 3 * layer + logits  # 2 layers + the top query layer
    assert model_flops_per_iteration(config, b, s) == 3 * forward == 8454144
    assert model_flops_per_iteration(config, b, s, checkpoint_activations=True) == 3 * forward + 3 * layer
    gpt2 = tiny_config(top_query_layer=False)
    assert model_flops_per_iteration(gpt2, b, s) == 3 * (2 * layer + logits)


@pytest.mark.parametrize("overrides, tp, message", [
    (dict(num_attention_heads=6, hidden_size=36), 4,
     "--num-attention-heads 6 is not divisible by --tensor-model-parallel-size 4"),
    (dict(hidden_size=30), 1, "--hidden-size 30 is not divisible by --num-attention-heads 4"),
    (dict(vocab_size=99, make_vocab_size_divisible_by=3), 2, "padded vocabulary 99"),
])
def test_bad_config_is_a_clear_error(overrides, tp, message):
    """Pure validation; the constructor runs the same check (at TP=2 in test_model_parallel)."""
    with pytest.raises(ModelConfigError, match=message):
        tiny_config(**overrides).validate(tp)
    if tp == 1:
        with pytest.raises(ModelConfigError, match=message):
            CodeGeeXModel(tiny_config(**overrides), None, None)


def test_bf16_model_runs():
    config = tiny_config()
    ids, pos, labels, _ = make_batch(config)
    model = CodeGeeXModel(config, None, None, dtype=torch.bfloat16)
    loss = model(ids, pos, labels=labels)
    assert loss.dtype == torch.float32 and torch.isfinite(loss).all()
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_sequence_longer_than_positions_is_a_clear_error():
    config = tiny_config(max_position_embeddings=8)
    model = CodeGeeXModel(config, None, None)
    ids, pos, _, _ = make_batch(tiny_config())  # length 16
    with pytest.raises(ModelConfigError, match="sequence length 16 .* exceeds --max-position-embeddings 8"):
        model(ids, pos)


@pytest.mark.parametrize("overrides", [
    {},
    dict(normalization="RMSNorm", swiglu=True, activation="gelu", untie_embeddings_and_output_weights=True,
         disable_bias_linear=True, add_qkv_bias=True, group_query_attention=True, num_query_groups=2,
         position_embedding_type="rope"),
], ids=["codegeex", "llama-like"])
def test_partition_table_matches_layer_tags(overrides):
    """(Every combination of the architecture switches: test_architecture_core.py.)"""
    config = tiny_config(**overrides)
    model = CodeGeeXModel(config, None, None)
    for name, p in model.named_parameters():
        tagged = (p.partition_dim, p.partition_stride) if getattr(p, "tensor_model_parallel", False) else None
        assert partition_spec(name, config) == tagged, name


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_split_then_merge_is_identity(tp):
    config = tiny_config()
    full = CodeGeeXModel(config, None, None).state_dict()
    shards = split_state_dict(full, config, tp)
    assert shards[0]["layers.0.attention.query_key_value.weight"].shape == (3 * 32 // tp, 32)
    merged = merge_state_dicts(shards, config)
    assert list(merged) == list(full) and all(torch.equal(merged[k], full[k]) for k in full)


def test_pipeline_stages_hold_the_same_weights_and_chain():
    config = tiny_config(num_layers=4)
    ids, pos, labels, _ = make_batch(config)
    whole = CodeGeeXModel(config, None, None, seed=9)
    first = CodeGeeXModel(config, None, None, seed=9, post_process=False, layer_numbers=range(0, 2))
    last = CodeGeeXModel(config, None, None, seed=9, pre_process=False, layer_numbers=range(2, 4))
    reference = whole.state_dict()
    for stage in (first, last):
        for name, tensor in stage.state_dict().items():
            assert torch.equal(tensor, reference[name]), name
    assert "position_embeddings.weight" not in last.state_dict() and "final_layernorm.weight" not in first.state_dict()
    assert last.word_embeddings.weight.shared_embedding and first.word_embeddings.weight.shared_embedding
    hidden = first(ids, pos)  # (b, s, h)
    assert hidden.shape == (B, S, config.hidden_size)
    assert max_err(last(hidden, pos, labels=labels), whole(ids, pos, labels=labels)) == 0.0


# --- Hugging Face GPT-2 and checkpoints ----------------------------------------------------------------

def test_hf_gpt2_converted_to_tp1_matches_hf(hf_checkpoints):
    config = hf_checkpoints["config"]
    model = CodeGeeXModel(config, None, None).eval()
    load_model_checkpoint(hf_checkpoints["ckpt"][1], model)
    ids, pos = hf_batch(config)
    with torch.no_grad():
        logits = model(ids, pos, gather_logits=True)
    assert max_err(logits[..., : config.vocab_size], hf_checkpoints["logits"]) <= 1e-4
    assert torch.count_nonzero(model.word_embeddings.weight[config.vocab_size:]) == 0  # padding rows are zero


def test_hf_round_trip_is_exact(hf_checkpoints, convert, tmp_path):
    from transformers import GPT2LMHeadModel

    original = hf_checkpoints["hf_model"].state_dict()
    config = hf_checkpoints["config"]
    direct = full_to_hf_gpt2(hf_gpt2_to_full(original, config), config)
    assert set(direct) == set(original) and all(torch.equal(direct[k], original[k]) for k in original)

    convert.main(["--load", str(hf_checkpoints["ckpt"][2]), "--to-hf", str(tmp_path / "back")])
    back = GPT2LMHeadModel.from_pretrained(tmp_path / "back").state_dict()
    assert set(back) == set(original)
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name


def test_reshard_tool_gives_the_same_weights(hf_checkpoints, convert, tmp_path):
    convert.main(["--load", str(hf_checkpoints["ckpt"][2]), "--save", str(tmp_path / "tp4"),
                  "--tensor-model-parallel-size", "4"])
    full_from_tp4, _, meta = load_full_state_dict(tmp_path / "tp4")
    full_from_tp1, _, _ = load_full_state_dict(hf_checkpoints["ckpt"][1])
    assert meta["tp_size"] == 4 and all(torch.equal(full_from_tp4[k], full_from_tp1[k]) for k in full_from_tp1)


def test_checkpoint_layout(hf_checkpoints):
    ckpt = hf_checkpoints["ckpt"][2]
    assert read_latest(ckpt) == "iter_0000000"
    assert sorted(p.name for p in (ckpt / "iter_0000000").iterdir()) == [
        "mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]
    state = torch.load(ckpt / "iter_0000000" / "mp_rank_01_model_states.pt", weights_only=False)
    assert set(state) == {"module", "codegeex_train"}
    assert state["codegeex_train"]["tp_size"] == 2 and state["codegeex_train"]["pp_size"] == 1
    assert state["module"]["word_embeddings.weight"].shape == (64, 32)  # rank 1's half of the padded 128


def test_checkpoint_shape_or_tp_mismatch_names_both(tmp_path):
    saved = tiny_config(hidden_size=64)
    save_model_checkpoint(tmp_path, split_state_dict(CodeGeeXModel(saved, None, None).state_dict(), saved, 2), saved, 2)
    with pytest.raises(CheckpointError, match="has .*hidden_size 64.*tp 2.*; this run has .*hidden_size 32.*tp 2"):
        load_model_shard(tmp_path, tiny_config(), tp_size=2, tp_rank=0)
    with pytest.raises(CheckpointError, match="tp 2, pp 1; this run has .*tp 1, pp 1; convert it with"):
        load_model_checkpoint(tmp_path, CodeGeeXModel(saved, None, None))


def test_missing_latest_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint in .*latest does not exist"):
        load_model_shard(tmp_path, tiny_config(), tp_size=1, tp_rank=0)


def test_crash_mid_save_leaves_no_latest(tmp_path, monkeypatch):
    config = tiny_config()
    shards = split_state_dict(CodeGeeXModel(config, None, None).state_dict(), config, 2)
    real_save, calls = torch.save, []

    def failing_save(obj, path):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full")
        real_save(obj, path)

    monkeypatch.setattr(checkpoint_module.torch, "save", failing_save)
    with pytest.raises(OSError):
        save_model_checkpoint(tmp_path, shards, config, 2)
    assert not (tmp_path / "latest").exists()
