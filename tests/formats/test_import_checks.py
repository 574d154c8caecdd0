"""--from-hf and --from-codegeex check what they read before they write: each field of the source config has its type,
no dimension is out of proportion to the weight files, every tensor is floating point, of the shape the config
implies and finite. Each refusal is one ``convert_checkpoint.py: error:`` line naming the file, the field or tensor,
the expected and the found value, and no checkpoint is written. Tiny random models built here; no hub."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from codegeex_train.formats.codegeex_release.weights import codegeex_checkpoint, full_to_codegeex
from codegeex_train.formats.huggingface.codegeex import copy_remote_code, full_to_hf_codegeex, hf_codegeex_config
from codegeex_train.model import CodeGeeXModel, ModelConfig
from tests.harness import load_tool

H = 32  # hidden size of every model here


@pytest.fixture(scope="module")
def convert():
    return load_tool("convert_checkpoint")


def _save(tensors: dict, path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """A GPT-2 (save_pretrained, 2 layers, sharded into several files), a CodeGeeX export and a released CodeGeeX
    file, each converting cleanly."""
    from transformers import GPT2Config, GPT2LMHeadModel

    root = tmp_path_factory.mktemp("import_sources")
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=100, n_positions=64, n_embd=H, n_layer=2, n_head=4,
                                      bos_token_id=None, eos_token_id=None))
    gpt2.save_pretrained(root / "gpt2", max_shard_size="40KB")
    assert len(list((root / "gpt2").glob("*.safetensors"))) > 2  # sharded: the message must name the right shard

    config = ModelConfig(num_layers=2, hidden_size=H, num_attention_heads=4, vocab_size=100,
                         max_position_embeddings=64, activation="fast_gelu")
    full = CodeGeeXModel(config, None, None, seed=3).state_dict()
    export = root / "codegeex"
    export.mkdir()
    (export / "config.json").write_text(json.dumps(hf_codegeex_config(config)))
    _save(full_to_hf_codegeex(full, config), export / "model.safetensors")
    copy_remote_code(export)

    released = config.with_vocab(128)  # the released file keeps its padded rows
    full = CodeGeeXModel(released, None, None, seed=3).state_dict()
    torch.save(codegeex_checkpoint(full_to_codegeex(full, released)), root / "codegeex_release.pt")
    return {"gpt2": root / "gpt2", "codegeex": export, "release": root / "codegeex_release.pt"}


def _convert(convert, argv: list[str], out: Path) -> str | None:
    """The error line of converting with ``argv`` into ``out`` (None when it converted)."""
    try:
        convert.main([*argv, "--save", str(out)])
    except SystemExit as e:
        assert isinstance(e.code, str) and "\n" not in e.code, e.code
        assert e.code.startswith("convert_checkpoint.py: error: "), e.code
        assert not (out / "latest").exists() and not list(out.glob("iter_*"))  # nothing written
        return e.code
    assert (out / "latest").is_file()
    return None


def _edit_hf(directory: Path, tensors=None, config=None) -> None:
    """Apply ``tensors(name, tensor) -> tensor`` to every tensor of every safetensors file, ``config(dict)`` to
    config.json."""
    from safetensors.torch import load_file

    if tensors is not None:
        for path in directory.glob("*.safetensors"):
            _save({k: tensors(k, v.clone()) for k, v in load_file(str(path)).items()}, path)
    if config is not None:
        d = json.loads((directory / "config.json").read_text())
        config(d)
        (directory / "config.json").write_text(json.dumps(d))


def _set(key, value):
    return lambda d: d.__setitem__(key, value)


def _replace(target: str, make):
    return lambda name, t: make(t) if name == target else t


def _nan_at_3(t: torch.Tensor) -> torch.Tensor:
    t.view(-1)[3] = float("nan")
    return t


def _shard_of(directory: Path, name: str) -> str:
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    return str(directory / index["weight_map"][name])


GPT2_CASES = {  # id: (tensors edit, config edit, what the line says ({d}: the directory, {shard}: the tensor's file))
    "layernorm_width": (_replace("transformer.h.1.ln_2.weight", lambda t: t[:16]), None,
                        ["{shard}: tensor transformer.h.1.ln_2.weight has shape (16,); {d}/config.json implies (32,)"]),
    "transposed_qkv": (_replace("transformer.h.0.attn.c_attn.weight", lambda t: t.t()), None,
                       ["tensor transformer.h.0.attn.c_attn.weight has shape (96, 32); {d}/config.json implies "
                        "(32, 96)"]),
    "int64": (lambda name, t: (t * 100).long(), None,
              ["{shard}: tensor transformer.wte.weight is int64; weights must be floating point"]),
    "nan": (_replace("transformer.h.1.mlp.c_fc.bias", _nan_at_3), None,
            ["{shard}: tensor transformer.h.1.mlp.c_fc.bias holds 1 non-finite value(s) (NaN or inf) of 128"]),
    "inf": (_replace("transformer.wpe.weight", lambda t: t.fill_(float("-inf"))), None,
            ["tensor transformer.wpe.weight holds 2,048 non-finite value(s)"]),
    "hidden_2_40": (None, _set("n_embd", 2**40),
                    ["{d}/config.json: n_embd 1,099,511,627,776 is more than all the weight files' values"]),
    "layers_2_40": (None, _set("n_layer", 2**40),
                    ["{d}/config.json: n_layer 1,099,511,627,776 implies 13,194,139,533,316 tensors; the weight "
                     "files hold"]),
    "layers_str": (None, _set("n_layer", "2"), ["{d}/config.json: field 'n_layer' is str '2'; expected an integer"]),
    "layers_float": (None, _set("n_layer", 2.0), ["field 'n_layer' is float 2.0; expected an integer"]),
    "layers_bool": (None, _set("n_layer", True), ["field 'n_layer' is bool True; expected an integer"]),
    "epsilon_str": (None, _set("layer_norm_epsilon", "1e-5"), ["field 'layer_norm_epsilon' is str '1e-5'; expected "
                                                              "a number"]),
    "inner_float": (None, _set("n_inner", 128.0), ["field 'n_inner' is float 128.0; expected an integer or null"]),
}
TENSOR_OF = {"layernorm_width": "transformer.h.1.ln_2.weight", "int64": "transformer.wte.weight",
             "nan": "transformer.h.1.mlp.c_fc.bias"}


@pytest.mark.parametrize("case", list(GPT2_CASES))
def test_from_hf_gpt2_refuses_what_its_config_does_not_describe(convert, sources, tmp_path, case):
    hf = tmp_path / "hf"
    shutil.copytree(sources["gpt2"], hf)
    tensors, config, fragments = GPT2_CASES[case]
    shard = _shard_of(hf, TENSOR_OF[case]) if case in TENSOR_OF else ""
    _edit_hf(hf, tensors, config)
    line = _convert(convert, ["--from-hf", str(hf)], tmp_path / "out")
    assert line is not None, f"{case}: converted"
    for fragment in fragments:
        assert fragment.format(d=hf, shard=shard) in line, line


CODEGEEX_CASES = {
    "layers_float": (None, _set("num_layers", 2.0), ["{d}/config.json: field 'num_layers' is float 2.0; expected an "
                                                    "integer"]),
    "top_query_int": (None, _set("top_query_layer", 1), ["field 'top_query_layer' is int 1; expected true or false"]),
    "hidden_2_40": (None, _set("hidden_size", 2**40), ["hidden_size 1,099,511,627,776 is more than all the weight"]),
    "transposed_qkv": (_replace("transformer.layers.1.attention.query_key_value.weight", lambda t: t.t()), None,
                       ["{d}/model.safetensors: tensor transformer.layers.1.attention.query_key_value.weight has "
                        "shape (32, 96); {d}/config.json implies (96, 32)"]),
    "int64_top_query": (_replace("transformer.top_query_embeddings.weight", lambda t: t.long()), None,
                        ["tensor transformer.top_query_embeddings.weight is int64"]),
    "nan": (_replace("transformer.final_layernorm.bias", _nan_at_3), None,
            ["tensor transformer.final_layernorm.bias holds 1 non-finite value(s)"]),
}


@pytest.mark.parametrize("case", list(CODEGEEX_CASES))
def test_from_hf_codegeex_refuses_what_its_config_does_not_describe(convert, sources, tmp_path, case):
    hf = tmp_path / "hf"
    shutil.copytree(sources["codegeex"], hf)
    tensors, config, fragments = CODEGEEX_CASES[case]
    _edit_hf(hf, tensors, config)
    line = _convert(convert, ["--from-hf", str(hf)], tmp_path / "out")
    assert line is not None, f"{case}: converted"
    for fragment in fragments:
        assert fragment.format(d=hf) in line, line


RELEASE = "language_model.transformer."
RELEASE_CASES = {  # a flat name of the released file -> the edit, what the line says
    "int64": (RELEASE + "layers.0.attention.dense.weight", lambda t: t.long(), "is int64; weights must be floating"),
    "layernorm_width": (RELEASE + "layers.1.input_layernorm.weight", lambda t: t[:16],
                        "has shape (16,); {path} (a 2-layer CodeGeeX model of hidden size 32, MLP width 128: read "
                        "off its shapes) implies (32,)"),
    "transposed_mlp": (RELEASE + "layers.0.mlp.dense_4h_to_h.weight", lambda t: t.t(), "has shape (128, 32)"),
    "inf": (RELEASE + "topQueryLayer.attention.value.bias", lambda t: t.fill_(float("inf")),
            "holds 32 non-finite value(s)"),
}


@pytest.mark.parametrize("case", list(RELEASE_CASES))
def test_from_codegeex_refuses_integer_misshapen_and_non_finite_weights(convert, sources, tmp_path, case):
    name, edit, fragment = RELEASE_CASES[case]
    checkpoint = torch.load(sources["release"], weights_only=True)
    transformer = checkpoint["module"]["language_model"]["transformer"]
    key = name.removeprefix(RELEASE)
    transformer[key] = edit(transformer[key].clone())
    path = tmp_path / "edited.pt"
    torch.save(checkpoint, path)
    line = _convert(convert, ["--from-codegeex", str(path), "--num-attention-heads", "4"], tmp_path / "out")
    assert line is not None, f"{case}: converted"
    assert f"--from-codegeex: {path}: tensor {name} " in line and fragment.format(path=path) in line, line


def test_the_unedited_sources_convert(convert, sources, tmp_path):
    """What the refusals above are measured against: each source converts as it is."""
    assert _convert(convert, ["--from-hf", str(sources["gpt2"])], tmp_path / "gpt2") is None
    assert _convert(convert, ["--from-hf", str(sources["codegeex"])], tmp_path / "codegeex") is None
    assert _convert(convert, ["--from-codegeex", str(sources["release"]), "--num-attention-heads", "4"],
                    tmp_path / "release") is None


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_from_hf_bounds_its_tokenizer_files(convert, sources, tmp_path, monkeypatch, name):
    from codegeex_train.formats.huggingface import tokenizer as hf_tokenizer
    from codegeex_train.tokenization.tokenizer import default_tokenizer

    hf = tmp_path / "hf"
    shutil.copytree(sources["gpt2"], hf)
    default_tokenizer(whitespace_encoding=False)._tokenizer.save(str(hf / "tokenizer.json"))
    padding = "x" * (hf / "tokenizer.json").stat().st_size  # the larger of the two
    (hf / "tokenizer_config.json").write_text(json.dumps({"comment": padding}))
    monkeypatch.setattr(hf_tokenizer, "MAX_TOKENIZER_FILE_BYTES", (hf / name).stat().st_size)
    (hf / name).write_text((hf / name).read_text() + " ")  # one byte past the bound
    line = _convert(convert, ["--from-hf", str(hf)], tmp_path / "out")
    assert line is not None and f"--from-hf {hf / name}: larger than " in line, line
    assert "the bound on this file" in line, line
