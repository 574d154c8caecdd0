"""Hugging Face ``LlamaForCausalLM`` (DeepSeek-Coder, CodeLlama, Llama 2 / 3) and ``MistralForCausalLM`` <-> our
config. The tensors are native.py's map.

A Llama is our decoder with RMSNorm (rms_norm_eps), SwiGLU (hidden_act silu), RoPE (rope_theta, and its scaling:
linear for DeepSeek-Coder and CodeLlama's long context, llama3 for Llama 3.1), grouped-query attention when
num_key_value_heads < num_attention_heads, no biases (attention_bias and mlp_bias together: one switch here) and
an untied lm_head unless tie_word_embeddings. A Mistral is a Llama without the bias switches and with a
sliding window (``sliding_window``: token i attends to i - W + 1 .. i, our --window-size); a Llama-shaped model
with a window exports as Mistral, without one as Llama.
"""

from __future__ import annotations

from codegeex_train.config.model_config import ModelConfig
from codegeex_train.formats.huggingface.native import Family, FormatError, decoder_fields, decoder_kwargs, \
    is_native_decoder

FIELD_TYPES = {"rms_norm_eps": "float", "attention_bias": "bool", "mlp_bias": "bool", "sliding_window": "int | None"}


def config_from_hf(hf, make_vocab_size_divisible_by: int = 128) -> ModelConfig:
    """Our ModelConfig for a ``transformers.LlamaConfig`` or ``MistralConfig``."""
    where = f"config.json ({hf.model_type})"
    if hf.hidden_act != "silu":
        raise FormatError(f"{where}: hidden_act {hf.hidden_act!r}: a Llama MLP converts with silu (SwiGLU) only")
    attention_bias, mlp_bias = getattr(hf, "attention_bias", False), getattr(hf, "mlp_bias", False)
    if attention_bias != mlp_bias:
        raise FormatError(f"{where}: attention_bias {attention_bias} with mlp_bias {mlp_bias}: here one switch "
                          f"(--disable-bias-linear) removes both or neither")
    config = ModelConfig(**decoder_fields(hf, make_vocab_size_divisible_by, where), normalization="RMSNorm",
                         swiglu=True, layernorm_epsilon=hf.rms_norm_eps, disable_bias_linear=not attention_bias,
                         window_size=getattr(hf, "sliding_window", None))
    config.check_architecture()
    return config


def architecture(config: ModelConfig) -> str | None:
    """LlamaForCausalLM or MistralForCausalLM (a window, no biases) for a Llama-shaped ``config``; else None."""
    if not (is_native_decoder(config) and config.normalization == "RMSNorm" and config.swiglu
            and config.qkv_bias == config.linear_bias):
        return None
    if config.window_size is None:
        return "LlamaForCausalLM"
    return None if config.linear_bias else "MistralForCausalLM"


def hf_config(config: ModelConfig, architecture: str, ids: dict):
    """The ``transformers`` config of ``architecture`` (``architecture(config)``'s answer)."""
    from transformers import LlamaConfig, MistralConfig

    common = dict(decoder_kwargs(config, architecture, ids), hidden_act="silu", rms_norm_eps=config.layernorm_epsilon,
                  head_dim=config.head_dim)
    if architecture == "MistralForCausalLM":
        return MistralConfig(**common, sliding_window=config.window_size)
    return LlamaConfig(**common, attention_bias=config.linear_bias, mlp_bias=config.linear_bias)


FAMILY = Family("Llama", ("llama", "mistral"), FIELD_TYPES, config_from_hf, architecture, hf_config)
