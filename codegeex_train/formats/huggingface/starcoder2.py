"""Hugging Face ``Starcoder2ForCausalLM`` (StarCoder2) <-> our config. The tensors are native.py's map.

A StarCoder2 is our decoder with LayerNorm (weights and biases; norm_epsilon), a plain MLP c_fc -> GeLU-tanh ->
c_proj (hidden_act gelu_pytorch_tanh, our gelu_tanh), every linear with a bias or none (``use_bias``,
--disable-bias-linear), RoPE, grouped-query attention and a sliding window on every layer (``sliding_window``,
our --window-size). Its dropouts: attention_dropout is ours; residual_dropout (on the attention and MLP outputs)
is our --hidden-dropout, which also covers the embeddings (embedding_dropout; written back equal to it).
"""

from __future__ import annotations

from codegeex_train.config.model_config import ModelConfig
from codegeex_train.formats.huggingface.native import Family, FormatError, decoder_fields, decoder_kwargs, \
    is_native_decoder

FIELD_TYPES = {"norm_epsilon": "float", "use_bias": "bool", "sliding_window": "int | None",
               "residual_dropout": "float", "embedding_dropout": "float"}
ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_new")  # both tanh-approximated GeLU: our gelu_tanh


def config_from_hf(hf, make_vocab_size_divisible_by: int = 128) -> ModelConfig:
    """Our ModelConfig for a ``transformers.Starcoder2Config``."""
    where = "config.json (starcoder2)"
    if hf.hidden_act not in ACTIVATIONS:
        raise FormatError(f"{where}: hidden_act {hf.hidden_act!r}: a StarCoder2 MLP converts with "
                          f"{' or '.join(ACTIVATIONS)} (our gelu_tanh) only")
    fields = decoder_fields(hf, make_vocab_size_divisible_by, where)
    fields["hidden_dropout"] = float(hf.residual_dropout)
    config = ModelConfig(**fields, normalization="LayerNorm", activation="gelu_tanh",
                         layernorm_epsilon=hf.norm_epsilon, disable_bias_linear=not hf.use_bias,
                         window_size=hf.sliding_window)
    config.check_architecture()
    return config


def architecture(config: ModelConfig) -> str | None:
    """Starcoder2ForCausalLM for a StarCoder2-shaped ``config`` (LayerNorm, GeLU-tanh, all biases or none); else
    None."""
    if (is_native_decoder(config) and config.normalization == "LayerNorm" and not config.swiglu
            and config.activation == "gelu_tanh" and config.qkv_bias == config.linear_bias):
        return "Starcoder2ForCausalLM"
    return None


def hf_config(config: ModelConfig, architecture: str, ids: dict):
    from transformers import Starcoder2Config

    return Starcoder2Config(**decoder_kwargs(config, architecture, ids), hidden_act="gelu_pytorch_tanh",
                            norm_epsilon=config.layernorm_epsilon, use_bias=config.linear_bias,
                            sliding_window=config.window_size, residual_dropout=config.hidden_dropout,
                            embedding_dropout=config.hidden_dropout)


FAMILY = Family("StarCoder2", ("starcoder2",), FIELD_TYPES, config_from_hf, architecture, hf_config)
