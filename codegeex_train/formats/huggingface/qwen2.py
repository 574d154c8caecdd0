"""Hugging Face ``Qwen2ForCausalLM`` (Qwen2.5-Coder) <-> our config. The tensors are native.py's map.

A Qwen2 is a Llama (RMSNorm, SwiGLU, RoPE, grouped-query attention) whose query, key and value projections have
biases and no other linear has (--disable-bias-linear --add-qkv-bias). Its sliding window covers the layers from
``max_window_layers`` on when ``use_sliding_window`` (transformers 5 spells it out as ``layer_types``): a window on
every layer converts (--window-size), on some layers only it is refused; the published Qwen2.5-Coder models use
none. Export writes a window as ``use_sliding_window`` with ``max_window_layers`` 0.
"""

from __future__ import annotations

from codegeex_train.config.model_config import ModelConfig
from codegeex_train.formats.huggingface.native import Family, FormatError, decoder_fields, decoder_kwargs, \
    is_native_decoder

FIELD_TYPES = {"rms_norm_eps": "float", "use_sliding_window": "bool", "sliding_window": "int | None",
               "max_window_layers": "int"}


def _window(hf, where: str) -> int | None:
    """The window every layer has, or None when no layer has one; refused when only some have."""
    kinds = set(hf.layer_types)
    if kinds == {"full_attention"}:
        return None
    if kinds == {"sliding_attention"}:
        return hf.sliding_window
    windowed = [i for i, kind in enumerate(hf.layer_types) if kind == "sliding_attention"]
    raise FormatError(f"{where}: a sliding window on layers {windowed[0]}..{windowed[-1]} only (use_sliding_window "
                      f"with max_window_layers {getattr(hf, 'max_window_layers', '?')} of {len(hf.layer_types)}): "
                      f"here a window covers every layer or none")


def config_from_hf(hf, make_vocab_size_divisible_by: int = 128) -> ModelConfig:
    """Our ModelConfig for a ``transformers.Qwen2Config``."""
    where = "config.json (qwen2)"
    if hf.hidden_act != "silu":
        raise FormatError(f"{where}: hidden_act {hf.hidden_act!r}: a Qwen2 MLP converts with silu (SwiGLU) only")
    config = ModelConfig(**decoder_fields(hf, make_vocab_size_divisible_by, where), normalization="RMSNorm",
                         swiglu=True, layernorm_epsilon=hf.rms_norm_eps, disable_bias_linear=True,
                         add_qkv_bias=True, window_size=_window(hf, where))
    config.check_architecture()
    return config


def architecture(config: ModelConfig) -> str | None:
    """Qwen2ForCausalLM for a Qwen2-shaped ``config`` (biases on Q, K, V only); else None."""
    if (is_native_decoder(config) and config.normalization == "RMSNorm" and config.swiglu and config.qkv_bias
            and not config.linear_bias):
        return "Qwen2ForCausalLM"
    return None


def hf_config(config: ModelConfig, architecture: str, ids: dict):
    from transformers import Qwen2Config

    window = config.window_size
    return Qwen2Config(**decoder_kwargs(config, architecture, ids), hidden_act="silu",
                       rms_norm_eps=config.layernorm_epsilon, use_sliding_window=window is not None,
                       sliding_window=window, max_window_layers=0 if window else config.num_layers)


FAMILY = Family("Qwen2", ("qwen2",), FIELD_TYPES, config_from_hf, architecture, hf_config)
