"""The family adapters' config side (formats/huggingface/llama.py, qwen2.py, starcoder2.py, native.py), no model run:
config.json -> ModelConfig -> the transformers config gives the same ModelConfig back; the published models' own
config.json spellings (transformers 4's top-level rope_theta and ``rope_scaling`` with "type") read as transformers
5's ``rope_parameters`` do; the export's class follows from the architecture alone; and each config (or weights
file) this stack has no equivalent for is refused in one line naming the field, before anything is written."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from codegeex_train.config.model_config import ModelConfig
from codegeex_train.formats.huggingface.adapter import FAMILIES, export_class
from codegeex_train.formats.huggingface.native import hf_shapes, import_source, tensor_exporter
from tests.harness import load_tool

# The published config.json of each family's models (the fields this import reads), as their hub pages have them.
DEEPSEEK_CODER_6_7B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
                       "hidden_size": 4096, "intermediate_size": 11008, "max_position_embeddings": 16384,
                       "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
                       "rms_norm_eps": 1e-06, "rope_scaling": {"factor": 4.0, "type": "linear"}, "rope_theta": 100000,
                       "tie_word_embeddings": False, "vocab_size": 32256, "bos_token_id": 32013, "eos_token_id": 32014}
QWEN25_CODER_7B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
                   "hidden_size": 3584, "intermediate_size": 18944, "max_position_embeddings": 32768,
                   "max_window_layers": 28, "num_attention_heads": 28, "num_hidden_layers": 28,
                   "num_key_value_heads": 4,
                   "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072,
                   "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 152064}
STARCODER2_7B = {"architectures": ["Starcoder2ForCausalLM"], "model_type": "starcoder2",
                 "hidden_act": "gelu_pytorch_tanh", "hidden_size": 4608, "intermediate_size": 18432,
                 "max_position_embeddings": 16384, "norm_epsilon": 1e-05, "num_attention_heads": 36,
                 "num_hidden_layers": 32, "num_key_value_heads": 4, "rope_theta": 1000000, "sliding_window": 4096,
                 "use_bias": True, "vocab_size": 49152, "attention_dropout": 0.1, "residual_dropout": 0.1,
                 "embedding_dropout": 0.1, "bos_token_id": 0, "eos_token_id": 0}
PUBLISHED = {"deepseek-coder-6.7b": (DEEPSEEK_CODER_6_7B, dict(
                 normalization="RMSNorm", swiglu=True, disable_bias_linear=True, rotary_base=100000,
                 rope_scaling="linear", rope_scaling_factor=4.0, group_query_attention=False,
                 untie_embeddings_and_output_weights=True, layernorm_epsilon=1e-6, window_size=None)),
             "qwen2.5-coder-7b": (QWEN25_CODER_7B, dict(
                 normalization="RMSNorm", swiglu=True, disable_bias_linear=True, add_qkv_bias=True,
                 rotary_base=1000000, rope_scaling="none", group_query_attention=True, num_query_groups=4,
                 untie_embeddings_and_output_weights=True, window_size=None)),
             "starcoder2-7b": (STARCODER2_7B, dict(
                 normalization="LayerNorm", swiglu=False, activation="gelu_tanh", disable_bias_linear=False,
                 rotary_base=1000000, group_query_attention=True, num_query_groups=4, window_size=4096,
                 untie_embeddings_and_output_weights=False, hidden_dropout=0.1, attention_dropout=0.1))}
CLASSES = {"deepseek-coder-6.7b": "LlamaForCausalLM", "qwen2.5-coder-7b": "Qwen2ForCausalLM",
           "starcoder2-7b": "Starcoder2ForCausalLM"}


def read(tmp_path, fields: dict) -> ModelConfig:
    """ModelConfig of a directory holding config.json only (the import reads the config before any weight)."""
    from codegeex_train.formats.huggingface.adapter import _model_config

    (tmp_path / "config.json").write_text(json.dumps(fields))
    return _model_config(str(tmp_path), fields, 128)


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_configs_read_and_write_back(tmp_path, name):
    fields, expected = PUBLISHED[name]
    config = read(tmp_path, fields)
    assert {k: getattr(config, k) for k in expected} == expected
    assert (config.num_layers, config.hidden_size, config.num_attention_heads, config.ffn_hidden_size,
            config.vocab_size, config.position_embedding_type, config.top_query_layer) == (
        fields["num_hidden_layers"], fields["hidden_size"], fields["num_attention_heads"],
        fields["intermediate_size"], fields["vocab_size"], "rope", False)
    family, architecture = export_class(config)
    assert architecture == CLASSES[name]
    written = family.hf_config(config, architecture, {"eos_token_id": 1, "bos_token_id": None, "pad_token_id": None})
    written.save_pretrained(tmp_path / "back")
    back = read(tmp_path / "back", json.loads((tmp_path / "back" / "config.json").read_text()))
    assert back == config


@pytest.mark.parametrize("rope", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192, "rope_theta": 500000.0},
    {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": 1e6},
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64, "beta_fast": 16.0, "beta_slow": 2.0,
     "attention_factor": 1.2, "rope_theta": 10000.0}])
def test_rope_scaling_reads_and_writes_back(tmp_path, rope):
    fields = {**DEEPSEEK_CODER_6_7B, "rope_scaling": None, "rope_parameters": rope}
    fields.pop("rope_theta")
    config = read(tmp_path, fields)
    kind = rope.get("rope_type", rope.get("type"))
    assert config.rope_scaling == kind and config.rope_scaling_factor == rope["factor"]
    assert config.rope_original_max_position_embeddings == rope["original_max_position_embeddings"]
    assert config.rotary_base == int(rope["rope_theta"])
    if kind == "yarn":
        assert (config.yarn_beta_fast, config.yarn_beta_slow, config.yarn_attention_factor) == (
            rope.get("beta_fast", 32.0), rope.get("beta_slow", 1.0), rope.get("attention_factor"))
    family, architecture = export_class(config)
    family.hf_config(config, architecture, {}).save_pretrained(tmp_path / "back")
    assert read(tmp_path / "back", json.loads((tmp_path / "back" / "config.json").read_text())) == config


def test_the_export_class_follows_from_the_architecture():
    llama = read_free(normalization="RMSNorm", swiglu=True, disable_bias_linear=True)
    assert export_class(llama)[1] == "LlamaForCausalLM"
    assert export_class(dataclasses.replace(llama, window_size=8))[1] == "MistralForCausalLM"
    assert export_class(dataclasses.replace(llama, disable_bias_linear=False))[1] == "LlamaForCausalLM"
    assert export_class(dataclasses.replace(llama, add_qkv_bias=True))[1] == "Qwen2ForCausalLM"
    starcoder2 = read_free(activation="gelu_tanh")
    assert export_class(starcoder2)[1] == "Starcoder2ForCausalLM"
    assert export_class(read_free(activation="gelu_tanh", position_embedding_type="learned_absolute"))[1] == \
        "GPT2LMHeadModel"
    assert export_class(read_free(top_query_layer=True))[1] == "CodeGeeXForCausalLM"  # CodeGeeX's own
    for odd in (dict(normalization="RMSNorm"),  # RMSNorm with a GeLU MLP: no class has it
                dict(normalization="RMSNorm", swiglu=True, disable_bias_linear=False, window_size=8),
                dict(activation="gelu_tanh", rotary_interleaved=True, group_query_attention=True,
                     num_query_groups=2)):
        with pytest.raises(Exception, match=r"--to-hf: no class --to-hf writes has this architecture") as e:
            export_class(read_free(**odd))
        assert "\n" not in str(e.value)


def read_free(**fields) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=100, top_query_layer=False,
                position_embedding_type="rope")
    return ModelConfig(**{**base, **fields})


def test_the_tensor_map_round_trips_and_slices_without_copying():
    for family_config in (read_free(normalization="RMSNorm", swiglu=True, disable_bias_linear=True,
                                    add_qkv_bias=True, group_query_attention=True, num_query_groups=2,
                                    untie_embeddings_and_output_weights=True),
                          read_free(activation="gelu_tanh", group_query_attention=True, num_query_groups=2)):
        g = torch.Generator().manual_seed(0)
        hf = {name: torch.randn(shape, generator=g) for name, shape in hf_shapes(family_config).items()}
        source = import_source(hf, family_config)
        export = tensor_exporter(family_config)
        from codegeex_train.model.shapes import model_parameter_shapes

        back = {}
        for name, shape in model_parameter_shapes(family_config).items():
            ours = source(name)
            assert tuple(ours.shape) == shape, name
            for hf_name, piece in export(name, ours):
                assert piece.data_ptr() >= ours.data_ptr() and piece.untyped_storage().data_ptr() == \
                    ours.untyped_storage().data_ptr()  # a view
                back[hf_name] = piece
        assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)


@pytest.mark.parametrize("change,fragment", [
    ({"head_dim": 64}, "head_dim 64 is not hidden_size / num_attention_heads"),
    ({"rope_theta": 10000.5}, "rope_theta 10000.5 is not an integer"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic' has no equivalent here"),
    ({"rope_scaling": {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096, "mscale": 0.7,
                       "mscale_all_dim": 0.7}}, "YaRN with mscale"),
    ({"attention_bias": True}, "attention_bias True with mlp_bias False"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"num_key_value_heads": 3}, "num_key_value_heads 3 does not divide"),
    ({"model_type": "gemma"}, "model_type 'gemma'"),
    ({"num_hidden_layers": "32"}, "field 'num_hidden_layers' is str"),
])
def test_configs_without_an_equivalent_are_refused_in_one_line(tmp_path, capsys, change, fragment):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**DEEPSEEK_CODER_6_7B, **change}))
    with pytest.raises(SystemExit) as stop:
        load_tool("convert_checkpoint").main(["--from-hf", str(tmp_path / "hf"), "--save", str(tmp_path / "out")])
    message = stop.value.code
    assert isinstance(message, str) and "\n" not in message and fragment in message, message
    assert not (tmp_path / "out" / "latest").exists()


def test_a_window_on_some_qwen2_layers_only_and_tp_past_the_groups_are_refused(tmp_path):
    convert = load_tool("convert_checkpoint")
    for name, fields, argv, fragment in (
            ("window", {**QWEN25_CODER_7B, "use_sliding_window": True, "max_window_layers": 20}, [],
             "a sliding window on layers 20..27 only"),
            ("tp4", {**QWEN25_CODER_7B, "hidden_size": 1536, "num_attention_heads": 12, "num_key_value_heads": 2},
             ["--tensor-model-parallel-size", "4"], "2"),  # Qwen2.5-Coder-1.5B's heads and groups
    ):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(fields))
        with pytest.raises(SystemExit) as stop:
            convert.main(["--from-hf", str(tmp_path / name), "--save", str(tmp_path / f"{name}_out"), *argv])
        assert "\n" not in stop.value.code and fragment in stop.value.code, stop.value.code
    assert "largest" in stop.value.code.lower()


def test_a_tensor_the_config_does_not_imply_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                 num_attention_heads=2)).save_pretrained(tmp_path / "hf")
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    weights["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(16)  # a bias config.json says is not there
    save_file(weights, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(SystemExit) as stop:
        load_tool("convert_checkpoint").main(["--from-hf", str(tmp_path / "hf"), "--save", str(tmp_path / "out")])
    assert "model.layers.0.self_attn.q_proj.bias, which its config.json does not imply" in stop.value.code
    assert len(FAMILIES) == 3
