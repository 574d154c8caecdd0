"""The released CodeGeeX weights: tools/convert_checkpoint.py --from-codegeex / --to-codegeex against the original
PyTorch model of the ``codegeex`` 1.0 package (codegeex/torch/codegeex_model.py), on a small random model.

The package is a test dependency (``make env``: ``pip install --no-deps codegeex==1.0``); without it these tests
fail, they do not skip. Its forward casts to fp16 in two places, which would hide any mapping error below fp16's
precision: the softmax output (``attention_softmax_in_fp32``, its own switch, turned off here so the softmax stays
in the input's dtype) and the output layer's weight (``F.linear(lm_output, word_embeddings.weight.half())``; we
apply ``F.linear`` to ``language_model``'s output with the fp32 weight, which is its forward otherwise). The
attention mask is the one its inference builds (``get_ltor_masks_and_position_ids``: True above the diagonal).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from model_helpers import max_err

from codegeex_train.checkpoint import load_full_state_dict, load_model_checkpoint
from codegeex_train.formats.codegeex_release.weights import (
    codegeex_checkpoint,
    codegeex_names,
    codegeex_state_dict,
    codegeex_to_full,
    config_from_codegeex,
    full_to_codegeex,
)
from codegeex_train.checkpoint.files import read_checkpoint_meta
from codegeex_train.config.model_config import ModelConfig
from codegeex_train.model import CodeGeeXModel, ModelGroups
from tests.harness import codegeex_reference, run_distributed

THEIR_MODEL = "codegeex.torch.codegeex_model"  # the original package's model: the reference

TOL = 1e-5
HIDDEN, LAYERS, HEADS, PADDED_VOCAB, POSITIONS = 32, 2, 4, 256, 16
B, S = 2, 16


def their_model(dtype: torch.dtype = torch.float32, seed: int = 0):
    """The package's CodeGeeXModel with every parameter random (LayerNorms and biases too, so that each name
    mapping matters), in ``dtype``, its softmax kept in that dtype."""
    torch.manual_seed(seed)
    model = codegeex_reference(THEIR_MODEL).CodeGeeXModel(HIDDEN, LAYERS, HEADS, PADDED_VOCAB, POSITIONS)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_((0.1 if p.dim() == 1 else 0.2) * torch.randn_like(p))
    for module in model.modules():
        if hasattr(module, "attention_softmax_in_fp32"):
            module.attention_softmax_in_fp32 = False
    return model.to(dtype).eval()


def their_logits(model, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    mask = torch.tril(torch.ones(1, 1, ids.shape[1], ids.shape[1])) < 0.5  # True: masked (the future)
    with torch.no_grad():
        hidden = model.language_model(ids, pos, mask)  # (b, s, h)
        return F.linear(hidden, model.language_model.embedding.word_embeddings.weight)  # (b, s, padded v)


def released_checkpoint(model) -> dict:
    """What the released file holds: {"module": model.state_dict_for_save_checkpoint()}."""
    with warnings.catch_warnings():  # the package calls state_dict(destination, prefix, keep_vars) positionally
        warnings.simplefilter("ignore", FutureWarning)
        return {"module": model.state_dict_for_save_checkpoint()}


def batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, PADDED_VOCAB, (B, S), generator=g), torch.arange(S).expand(B, S)


def assert_same_tree(a: dict, b: dict, path: str = "") -> None:
    """Same keys in the same order at every level; bit-identical tensors of the same dtype."""
    assert list(a) == list(b), path
    for key in a:
        if isinstance(a[key], dict):
            assert isinstance(b[key], dict), path + key
            assert_same_tree(a[key], b[key], f"{path}{key}/")
        else:
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), path + key


@pytest.fixture(scope="module")
def released(tmp_path_factory, convert):
    """The fp32 package model saved in the released layout, its logits, and the file converted at TP 1 and 2."""
    root = tmp_path_factory.mktemp("codegeex")
    model = their_model()
    path = root / "codegeex_fp32.pt"
    torch.save(released_checkpoint(model), path)
    ids, pos = batch()
    ckpt = {}
    for tp in (1, 2):
        ckpt[tp] = root / f"ours_tp{tp}"
        convert.main(["--from-codegeex", str(path), "--num-attention-heads", str(HEADS), "--save", str(ckpt[tp]),
                      "--tensor-model-parallel-size", str(tp)])
    config = ModelConfig(**read_checkpoint_meta(ckpt[1])[1]["model_config"])
    return {"model": model, "path": path, "ids": ids, "pos": pos, "logits": their_logits(model, ids, pos),
            "ckpt": ckpt, "config": config}


# --- The mapping ------------------------------------------------------------------------------------------

def test_names_are_the_packages_and_the_config_is_read_off_the_shapes(released):
    model = released["model"]
    flat = codegeex_state_dict(torch.load(released["path"], weights_only=True))
    assert list(flat) == list(model.state_dict()) == codegeex_names(LAYERS)
    config = released["config"]
    assert (config.num_layers, config.hidden_size, config.num_attention_heads, config.ffn_hidden_size,
            config.max_position_embeddings, config.padded_vocab_size) == (LAYERS, HIDDEN, HEADS, 4 * HIDDEN,
                                                                          POSITIONS, PADDED_VOCAB)
    assert (config.activation, config.top_query_layer, config.layernorm_epsilon) == ("fast_gelu", True, 1e-5)
    # Our model's names and order, and the package's load of the layout we write, strict.
    full = codegeex_to_full(flat, config)
    assert list(full) == list(CodeGeeXModel(config, None, None).state_dict())
    fresh = their_model(seed=1)
    fresh.load_state_dict(codegeex_checkpoint(full_to_codegeex(full, config))["module"], strict=True)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))


def test_fused_qkv_blocks_and_tp2_shards(released):
    """Full: [Q; K; V] and the top query layer's [K; V]; TP rank r: the rows of its heads of each block."""
    flat = codegeex_state_dict(torch.load(released["path"], weights_only=True))
    t = "language_model.transformer."
    full, _, _ = load_full_state_dict(released["ckpt"][1])
    for p in ("weight", "bias"):
        assert torch.equal(full[f"layers.1.attention.query_key_value.{p}"],
                           torch.cat([flat[f"{t}layers.1.attention.{n}.{p}"] for n in ("query", "key", "value")]))
        assert torch.equal(full[f"top_query_layer.attention.key_value.{p}"],
                           torch.cat([flat[f"{t}topQueryLayer.attention.{n}.{p}"] for n in ("key", "value")]))
    half = HIDDEN // 2
    for rank in range(2):
        shard = torch.load(released["ckpt"][2] / "iter_0000000" / f"mp_rank_{rank:02d}_model_states.pt",
                           weights_only=True)["module"]
        rows = slice(rank * half, (rank + 1) * half)
        assert torch.equal(shard["layers.0.attention.query_key_value.weight"],
                           torch.cat([flat[f"{t}layers.0.attention.{n}.weight"][rows] for n in ("query", "key",
                                                                                                 "value")]))
        assert torch.equal(shard["top_query_layer.attention.key_value.bias"],
                           torch.cat([flat[f"{t}topQueryLayer.attention.{n}.bias"][rows] for n in ("key", "value")]))
        assert torch.equal(shard["top_query_layer.attention.query.weight"],
                           flat[f"{t}topQueryLayer.attention.query.weight"][rows])


# --- Logits -------------------------------------------------------------------------------------------------

def test_tp1_logits_equal_the_codegeex_package(released):
    model = CodeGeeXModel(released["config"], None, None).eval()
    load_model_checkpoint(released["ckpt"][1], model)
    with torch.no_grad():
        logits = model(released["ids"], released["pos"], gather_logits=True)
    assert logits.shape == released["logits"].shape == (B, S, PADDED_VOCAB)
    err = max_err(logits, released["logits"])
    assert err <= TOL, f"TP 1 logits differ from the codegeex package's by {err:.3g}"
    # Training's config (vocab from the tokenizer, padded by the flag; CodeGeeX-13B: 50400 by 52224) loads it.
    flags = ModelConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, vocab_size=200,
                        make_vocab_size_divisible_by=PADDED_VOCAB, max_position_embeddings=POSITIONS,
                        activation="fast_gelu", hidden_dropout=0.0, attention_dropout=0.0)
    model = CodeGeeXModel(flags, None, None).eval()
    load_model_checkpoint(released["ckpt"][1], model)
    with torch.no_grad():
        assert torch.equal(model(released["ids"], released["pos"], gather_logits=True), logits)


def _tp_logits(topo, ckpt_dir: str, config: ModelConfig, ids, pos, expected) -> tuple[float, int]:
    model = CodeGeeXModel(config, ModelGroups.from_topology(topo)).eval()
    meta = load_model_checkpoint(ckpt_dir, model)
    with torch.no_grad():
        logits = model(ids, pos, gather_logits=True)
    return max_err(logits, expected), meta["tp_size"]


@pytest.mark.slow
def test_tp2_logits_equal_the_codegeex_package(released):
    results = run_distributed(_tp_logits, world_size=2, tp_size=2, ckpt_dir=str(released["ckpt"][2]),
                              config=released["config"], ids=released["ids"], pos=released["pos"],
                              expected=released["logits"])
    for rank, (err, tp_size) in enumerate(results):
        assert tp_size == 2
        assert err <= TOL, f"rank {rank}: TP 2 logits differ from the codegeex package's by {err:.3g}"


# --- Round trips --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_mapping_round_trip_is_exact(dtype):
    flat = {k: v for k, v in their_model(dtype).state_dict().items()}
    config = config_from_codegeex(flat, HEADS)
    full = codegeex_to_full(flat, config)
    assert all(v.dtype == dtype for v in full.values())
    back = full_to_codegeex(full, config)
    assert list(back) == list(flat)
    assert all(back[k].dtype == dtype and torch.equal(back[k], flat[k]) for k in flat)


@pytest.mark.parametrize("dtype,legacy,tp,pp", [(torch.float16, True, 2, 2), (torch.float16, False, 1, 1),
                                                (torch.float32, False, 2, 1)])
def test_file_round_trip_is_bit_exact(convert, tmp_path, dtype, legacy, tp, pp):
    """FILE -> ours (TP x PP) -> FILE: same nesting, keys, order, dtypes and bits; fp16 as released."""
    model = their_model(dtype)
    original = released_checkpoint(model)
    src = tmp_path / "codegeex.pt"
    torch.save(original, src, _use_new_zipfile_serialization=not legacy)  # the released file may be either
    convert.main(["--from-codegeex", str(src), "--num-attention-heads", str(HEADS), "--save", str(tmp_path / "ours"),
                  "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)])
    stored, _, meta = load_full_state_dict(tmp_path / "ours")
    assert (meta["tp_size"], meta["pp_size"]) == (tp, pp) and all(v.dtype == dtype for v in stored.values())
    convert.main(["--load", str(tmp_path / "ours"), "--to-codegeex", str(tmp_path / "back.pt")])
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert_same_tree(back, original)
    if dtype == torch.float32:  # and the package runs the written file as it ran the original
        reloaded = their_model(seed=3)
        reloaded.load_state_dict(back["module"], strict=True)
        ids, pos = batch()
        assert torch.equal(their_logits(reloaded, ids, pos), their_logits(model, ids, pos))


# --- Errors -------------------------------------------------------------------------------------------------

def _tool_error(convert, capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        convert.main(argv)
    code = exit_info.value.code
    if isinstance(code, str):  # our one line (argparse's usage errors exit 2 and print to stderr instead)
        assert code.startswith("convert_checkpoint.py: error: ") and "\n" not in code
        return code
    assert code == 2
    return capsys.readouterr().err


def test_bad_input_is_one_error_line(released, convert, capsys, tmp_path):
    path = str(released["path"])
    assert "needs --num-attention-heads" in _tool_error(convert, capsys, ["--from-codegeex", path, "--save",
                                                                          str(tmp_path / "x")])
    assert not (tmp_path / "x").exists()
    assert "--hidden-size 32 is not divisible by --num-attention-heads 5" in _tool_error(
        convert, capsys, ["--from-codegeex", path, "--num-attention-heads", "5", "--save", str(tmp_path / "o")])
    assert "--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 8" in _tool_error(
        convert, capsys, ["--from-codegeex", path, "--num-attention-heads", "4", "--save", str(tmp_path / "o"),
                          "--tensor-model-parallel-size", "8"])
    assert not (tmp_path / "o").exists()

    incomplete = released_checkpoint(released["model"])
    del incomplete["module"]["language_model"]["transformer"]["layers.1.attention.value.bias"]
    torch.save(incomplete, tmp_path / "incomplete.pt")
    message = _tool_error(convert, capsys, ["--from-codegeex", str(tmp_path / "incomplete.pt"),
                                            "--num-attention-heads", "4", "--save", str(tmp_path / "o")])
    assert "incomplete.pt" in message and "layers.1.attention.value.bias" in message

    ours = released["ckpt"][1] / "iter_0000000" / "mp_rank_00_model_states.pt"  # our layout is not theirs
    assert "not a CodeGeeX checkpoint" in _tool_error(
        convert, capsys, ["--from-codegeex", str(ours), "--num-attention-heads", "4", "--save", str(tmp_path / "o")])

    class Payload:  # a pickle that would create a file when loaded: refused, nothing run
        def __reduce__(self):
            return (os.mkdir, (str(tmp_path / "pwned"),))

    torch.save({"module": {"language_model": Payload()}}, tmp_path / "evil.pt")
    assert "refusing checkpoint file" in _tool_error(
        convert, capsys, ["--from-codegeex", str(tmp_path / "evil.pt"), "--num-attention-heads", "4", "--save",
                          str(tmp_path / "o")])
    assert not (tmp_path / "pwned").exists()


def test_to_codegeex_refuses_a_model_that_is_not_codegeex(convert, capsys, tmp_path, hf_checkpoints):
    message = _tool_error(convert, capsys, ["--load", str(hf_checkpoints["ckpt"][1]), "--to-codegeex",
                                            str(tmp_path / "x.pt")])
    assert "not a CodeGeeX model" in message and "--activation gelu_tanh" in message
    assert not (tmp_path / "x.pt").exists()
    assert "--to-codegeex writes one unsplit CodeGeeX file" in _tool_error(
        convert, capsys, ["--load", str(tmp_path / "x"), "--to-codegeex", str(tmp_path / "y"),
                          "--tensor-model-parallel-size", "2"])
    assert not (tmp_path / "y").exists()
