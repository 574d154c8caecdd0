"""Hugging Face GPT-2 (``GPT2LMHeadModel``) <-> our full (TP=1) state dict and config. Pure functions.

A GPT-2 is our model without the top query layer, with ``gelu_tanh`` (GPT-2's ``gelu_new``) and the word table
tied to the output layer; HF's ``Conv1D`` stores weights as (in, out) where our ``nn.Linear`` has (out, in).
"""

from __future__ import annotations

import torch

from codegeex_train.model.shapes import model_parameter_shapes
from codegeex_train.config.model_config import ModelConfig

# Our per-layer name -> GPT-2's (transformer.h.{i}.) name, and whether HF's Conv1D stores it (in, out).
LAYER_MAP: tuple[tuple[str, str, bool], ...] = (
    ("input_layernorm.weight", "ln_1.weight", False),
    ("input_layernorm.bias", "ln_1.bias", False),
    ("attention.query_key_value.weight", "attn.c_attn.weight", True),
    ("attention.query_key_value.bias", "attn.c_attn.bias", False),
    ("attention.dense.weight", "attn.c_proj.weight", True),
    ("attention.dense.bias", "attn.c_proj.bias", False),
    ("post_attention_layernorm.weight", "ln_2.weight", False),
    ("post_attention_layernorm.bias", "ln_2.bias", False),
    ("mlp.dense_h_to_4h.weight", "mlp.c_fc.weight", True),
    ("mlp.dense_h_to_4h.bias", "mlp.c_fc.bias", False),
    ("mlp.dense_4h_to_h.weight", "mlp.c_proj.weight", True),
    ("mlp.dense_4h_to_h.bias", "mlp.c_proj.bias", False),
)

# config.json's fields the import reads, with their types (checked first: transformers' GPT2Config fills in those
# missing with its defaults).
CONFIG_FIELD_TYPES = {"n_layer": "int", "n_embd": "int", "n_head": "int", "n_inner": "int | None", "n_positions": "int",
                      "vocab_size": "int", "activation_function": "str", "resid_pdrop": "float", "embd_pdrop": "float",
                      "attn_pdrop": "float", "layer_norm_epsilon": "float", "initializer_range": "float",
                      "scale_attn_weights": "bool", "scale_attn_by_inverse_layer_idx": "bool",
                      "add_cross_attention": "bool"}
# Our ModelConfig field -> GPT2Config's name for it (messages name the file's).
FIELD_NAMES = {"num_layers": "n_layer", "hidden_size": "n_embd", "num_attention_heads": "n_head",
               "ffn_hidden_size": "n_inner", "max_position_embeddings": "n_positions"}


def hf_gpt2_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The ``GPT2LMHeadModel`` tensors an import reads (``transformer.`` names) with the shapes ``config`` implies:
    ours, the word table unpadded, Conv1D weights (in, out)."""
    ours = model_parameter_shapes(config)
    shapes = {"transformer.wte.weight": (config.vocab_size, config.hidden_size),
              "transformer.wpe.weight": ours["position_embeddings.weight"]}
    for i in range(config.num_layers):
        for name, theirs, conv1d in LAYER_MAP:
            shape = ours[f"layers.{i}.{name}"]
            shapes[f"transformer.h.{i}.{theirs}"] = shape[::-1] if conv1d else shape
    for p in ("weight", "bias"):
        shapes[f"transformer.ln_f.{p}"] = ours[f"final_layernorm.{p}"]
    return shapes


def config_from_hf_gpt2(hf_config, make_vocab_size_divisible_by: int = 128) -> ModelConfig:
    """Our ModelConfig for a ``transformers.GPT2Config`` (no top query layer, GPT-2's gelu_new)."""
    if hf_config.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"GPT-2 activation {hf_config.activation_function!r} has no equivalent here "
                         f"(we support gelu_new as gelu_tanh)")
    if (not hf_config.scale_attn_weights or hf_config.scale_attn_by_inverse_layer_idx
            or getattr(hf_config, "add_cross_attention", False)):
        raise ValueError("only GPT-2's standard attention (scaled by 1/sqrt(d), no cross attention) converts")
    return ModelConfig(
        num_layers=hf_config.n_layer, hidden_size=hf_config.n_embd, num_attention_heads=hf_config.n_head,
        ffn_hidden_size=hf_config.n_inner or 4 * hf_config.n_embd, max_position_embeddings=hf_config.n_positions,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by, hidden_dropout=hf_config.resid_pdrop,
        attention_dropout=hf_config.attn_pdrop, layernorm_epsilon=hf_config.layer_norm_epsilon,
        activation="gelu_tanh", top_query_layer=False, init_method_std=hf_config.initializer_range,
        vocab_size=hf_config.vocab_size)


def hf_gpt2_config(config: ModelConfig):
    """The ``transformers.GPT2Config`` of a model without the top query layer."""
    from transformers import GPT2Config

    if config.rope:
        raise ValueError("a --position-embedding-type rope model is not a GPT-2 (GPT-2 has learned positions): "
                         "it exports as CodeGeeX remote code (codegeex.py)")
    if config.top_query_layer or config.activation != "gelu_tanh":
        raise ValueError(f"only a model with --no-top-query-layer and --activation gelu_tanh is a GPT-2 "
                         f"(this one: top_query_layer={config.top_query_layer}, activation={config.activation})")
    return GPT2Config(vocab_size=config.vocab_size, n_positions=config.max_position_embeddings,
                      n_embd=config.hidden_size, n_layer=config.num_layers, n_head=config.num_attention_heads,
                      n_inner=config.ffn_hidden_size, activation_function="gelu_new",
                      resid_pdrop=config.hidden_dropout, embd_pdrop=config.hidden_dropout,
                      attn_pdrop=config.attention_dropout, layer_norm_epsilon=config.layernorm_epsilon,
                      initializer_range=config.init_method_std, tie_word_embeddings=True)


def hf_gpt2_to_full(hf_sd: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """A ``GPT2LMHeadModel`` state dict -> our TP=1 state dict (word table zero-padded to the padded vocab)."""
    sd = {k.removeprefix("transformer."): v for k, v in hf_sd.items()}
    wte = sd["wte.weight"]  # (V, h)
    padding = wte.new_zeros(config.padded_vocab_size - wte.shape[0], wte.shape[1])
    full = {"word_embeddings.weight": torch.cat([wte, padding]), "position_embeddings.weight": sd["wpe.weight"]}
    for i in range(config.num_layers):
        for ours, theirs, conv1d in LAYER_MAP:
            t = sd[f"h.{i}.{theirs}"]
            full[f"layers.{i}.{ours}"] = t.t() if conv1d else t  # Conv1D is (in, out); Linear is (out, in)
    full["final_layernorm.weight"], full["final_layernorm.bias"] = sd["ln_f.weight"], sd["ln_f.bias"]
    return {k: v.detach().clone().contiguous() for k, v in full.items()}


def full_to_hf_gpt2(full_sd: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Our TP=1 state dict -> a ``GPT2LMHeadModel`` state dict (padding rows trimmed, lm_head tied)."""
    hf_config = hf_gpt2_config(config)  # refuses models that are not GPT-2
    wte = full_sd["word_embeddings.weight"][: hf_config.vocab_size]
    hf = {"transformer.wte.weight": wte, "transformer.wpe.weight": full_sd["position_embeddings.weight"]}
    for i in range(config.num_layers):
        for ours, theirs, conv1d in LAYER_MAP:
            t = full_sd[f"layers.{i}.{ours}"]
            hf[f"transformer.h.{i}.{theirs}"] = t.t() if conv1d else t
    hf["transformer.ln_f.weight"] = full_sd["final_layernorm.weight"]
    hf["transformer.ln_f.bias"] = full_sd["final_layernorm.bias"]
    hf["lm_head.weight"] = wte
    return {k: v.detach().clone().contiguous() for k, v in hf.items()}
