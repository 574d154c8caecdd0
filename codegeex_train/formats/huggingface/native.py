"""The native transformers decoders (Llama, Mistral, Qwen2, StarCoder2) <-> our full (TP=1) tensors and config
fields: what the family adapters (llama.py, qwen2.py, starcoder2.py) share. Pure functions.

The four classes have one module tree, ours in other words; each of our tensors is its HF pieces stacked along the
rows (dim 0)::

    model.embed_tokens.weight                    word_embeddings.weight (+ zero rows up to the padded vocabulary)
    model.layers.{i}.input_layernorm.*           layers.{i}.input_layernorm.*
    model.layers.{i}.self_attn.{q,k,v}_proj.*    layers.{i}.attention.query_key_value.*  [Q (n d); K (g d); V (g d)]
    model.layers.{i}.self_attn.o_proj.*          layers.{i}.attention.dense.*
    model.layers.{i}.post_attention_layernorm.*  layers.{i}.post_attention_layernorm.*
    model.layers.{i}.mlp.{gate,up}_proj.*        layers.{i}.mlp.dense_h_to_4h.*  [gate; up] (SwiGLU: Llama, Qwen2)
    model.layers.{i}.mlp.c_fc.*                  layers.{i}.mlp.dense_h_to_4h.*             (StarCoder2)
    model.layers.{i}.mlp.{down_proj,c_proj}.*    layers.{i}.mlp.dense_4h_to_h.*
    model.norm.*                                 final_layernorm.*
    lm_head.weight                               output_layer.weight (untied only; + zero rows as the word table)

An import concatenates the pieces (``import_source``, one of our tensors when asked for it: streaming), an export
slices them apart (``tensor_exporter``, views) and drops the padding rows: the round trip gives back the same bits.
Config fields all four share (shapes, grouped-query attention, tying, RoPE and its scaling) are read and written
here; each adapter adds its own (norm, biases, activation, window).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from codegeex_train.model.shapes import model_parameter_shapes
from codegeex_train.config.model_config import ModelConfig

VOCAB_TABLES = {"word_embeddings.weight": "model.embed_tokens.weight", "output_layer.weight": "lm_head.weight"}
# Buffers older save_pretrained wrote beside the weights (recomputed from the config): never read.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
# config.json fields every family reads, with their types (checked before transformers fills in defaults).
DECODER_FIELD_TYPES = {"num_hidden_layers": "int", "hidden_size": "int", "num_attention_heads": "int",
                       "num_key_value_heads": "int | None", "intermediate_size": "int", "head_dim": "int | None",
                       "max_position_embeddings": "int", "vocab_size": "int", "hidden_act": "str",
                       "tie_word_embeddings": "bool", "attention_dropout": "float", "initializer_range": "float",
                       "rope_theta": "float"}
# Our ModelConfig field -> config.json's name for it (messages name the file's).
FIELD_NAMES = {"num_layers": "num_hidden_layers", "ffn_hidden_size": "intermediate_size"}
ROPE_KEYS = {"default": (), "linear": ("factor",),
             "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
             "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor",
                      "truncate", "mscale", "mscale_all_dim")}


class FormatError(ValueError):
    """A Hugging Face config this stack has no equivalent for; one line naming the field."""


@dataclass(frozen=True)
class Family:
    """One native transformers class family: its config.json model types, how its config maps to ours and back,
    and which of our models it can hold."""

    name: str
    model_types: tuple[str, ...]
    field_types: Mapping[str, str]  # config.json fields it reads beyond DECODER_FIELD_TYPES
    config_from_hf: Callable[[object, int], ModelConfig]  # (transformers config, --make-vocab-size-divisible-by)
    architecture: Callable[[ModelConfig], str | None]  # the class it exports ``config`` as; None: not this family
    hf_config: Callable[[ModelConfig, str, dict], object]  # (config, class name, token ids) -> transformers config


def _pieces(config: ModelConfig) -> dict[str, list[tuple[str, int]]]:
    """Our parameter name -> its HF pieces (name, rows) in row order, in our model's order."""
    ours = model_parameter_shapes(config)
    d, n, g = config.head_dim, config.num_attention_heads, config.kv_groups
    ffn = config.ffn_hidden_size
    mlp_in = [("gate_proj", ffn), ("up_proj", ffn)] if config.swiglu else [("c_fc", ffn)]
    mlp_out = "down_proj" if config.swiglu else "c_proj"
    layer = {"input_layernorm": [("input_layernorm", None)],
             "attention.query_key_value": [("self_attn.q_proj", n * d), ("self_attn.k_proj", g * d),
                                           ("self_attn.v_proj", g * d)],
             "attention.dense": [("self_attn.o_proj", None)],
             "post_attention_layernorm": [("post_attention_layernorm", None)],
             "mlp.dense_h_to_4h": [(f"mlp.{name}", rows) for name, rows in mlp_in],
             "mlp.dense_4h_to_h": [(f"mlp.{mlp_out}", None)]}
    pieces = {}
    for name, shape in ours.items():
        if name in VOCAB_TABLES:
            pieces[name] = [(VOCAB_TABLES[name], config.vocab_size)]  # the padding rows: ours only
        elif name.startswith("final_layernorm."):
            pieces[name] = [("model.norm." + name.removeprefix("final_layernorm."), shape[0])]
        elif name.startswith("layers."):
            _, i, rest = name.split(".", 2)
            module, param = rest.rsplit(".", 1)
            pieces[name] = [(f"model.layers.{i}.{theirs}.{param}", shape[0] if rows is None else rows)
                            for theirs, rows in layer[module]]
        else:
            raise FormatError(f"{name}: no native transformers class holds this parameter (a learned position table "
                              f"or CodeGeeX's top query layer)")
    return pieces


def hf_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The HF tensors of a model of ``config`` with their shapes (the vocabulary tables unpadded)."""
    ours = model_parameter_shapes(config)
    return {hf: (rows, *ours[name][1:]) for name, parts in _pieces(config).items() for hf, rows in parts}


def ignored(hf_name: str, config: ModelConfig) -> bool:
    """A tensor an import leaves unread: a recomputed buffer, or the tied lm_head (the word table itself)."""
    return hf_name.endswith(IGNORED_SUFFIXES) or (hf_name == VOCAB_TABLES["output_layer.weight"]
                                                  and config.tied_output)


def import_source(tensors: Mapping[str, torch.Tensor], config: ModelConfig) -> Callable[[str], torch.Tensor]:
    """Our name -> our full tensor, built from the (mapped) HF ``tensors`` when asked for: its pieces concatenated,
    a vocabulary table zero-padded to the padded vocabulary."""
    pieces = _pieces(config)

    def get(name: str) -> torch.Tensor:
        parts = [tensors[hf] for hf, _ in pieces[name]]
        if name in VOCAB_TABLES:
            table = parts[0]  # (V, h)
            parts.append(table.new_zeros(config.padded_vocab_size - table.shape[0], table.shape[1]))
        return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts)

    return get


def tensor_exporter(config: ModelConfig) -> Callable[[str, torch.Tensor], list[tuple[str, torch.Tensor]]]:
    """(our name, our full tensor) -> its HF (name, tensor) pieces: row slices (views), the padding rows left out."""
    pieces = _pieces(config)

    def export(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        out, start = [], 0
        for hf, rows in pieces[name]:
            out.append((hf, tensor.narrow(0, start, rows)))
            start += rows
        return out

    return export


# --- config -------------------------------------------------------------------------------------------------------

def _integer(value: float, field: str, where: str) -> int:
    if isinstance(value, bool) or not float(value).is_integer():
        raise FormatError(f"{where}: {field} {value} is not an integer (our --rotary-base and position counts are)")
    return int(value)


def rope_fields(params: Mapping, where: str) -> dict:
    """Our RoPE fields of transformers' ``rope_parameters`` (rope_theta, rope_type and its fields; transformers
    reads older files' top-level rope_theta and ``rope_scaling`` into it)."""
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_KEYS:
        raise FormatError(f"{where}: rope_type {kind!r} has no equivalent here (default, linear, llama3 and yarn do)")
    unknown = set(params) - {"rope_theta", "rope_type", "type", *ROPE_KEYS[kind]}
    if params.get("partial_rotary_factor", 1.0) == 1.0:
        unknown.discard("partial_rotary_factor")
    if unknown:
        raise FormatError(f"{where}: RoPE field(s) {', '.join(sorted(unknown))} of rope_type {kind!r} have no "
                          f"equivalent here")
    fields = {"position_embedding_type": "rope", "rotary_base": _integer(params.get("rope_theta", 10000.0),
                                                                         "rope_theta", where)}
    if kind == "default":
        return fields
    if params.get("factor") is None:
        raise FormatError(f"{where}: rope_type {kind!r} without a factor")
    fields.update(rope_scaling=kind, rope_scaling_factor=float(params["factor"]))
    if kind == "linear":
        return fields
    original = params.get("original_max_position_embeddings")
    if original is None:
        raise FormatError(f"{where}: rope_type {kind!r} without original_max_position_embeddings")
    fields["rope_original_max_position_embeddings"] = _integer(original, "original_max_position_embeddings", where)
    if kind == "llama3":
        fields.update(rope_low_freq_factor=float(params["low_freq_factor"]),
                      rope_high_freq_factor=float(params["high_freq_factor"]))
        return fields
    if params.get("mscale") or params.get("mscale_all_dim") or params.get("truncate", True) is not True:
        raise FormatError(f"{where}: YaRN with mscale, mscale_all_dim or truncate false (DeepSeek-V3's variants) has "
                          f"no equivalent here")
    attention = params.get("attention_factor")
    fields.update(yarn_beta_fast=float(params.get("beta_fast") or 32.0),  # transformers' defaults for 0 / None too
                  yarn_beta_slow=float(params.get("beta_slow") or 1.0),
                  yarn_attention_factor=None if attention is None else float(attention))
    return fields


def rope_parameters(config: ModelConfig) -> dict:
    """transformers' ``rope_parameters`` of our RoPE fields (``rope_fields`` read back gives them again)."""
    params = {"rope_theta": float(config.rotary_base), "rope_type": "default"}
    kind = config.rope_scaling
    if kind == "none":
        return params
    params.update(rope_type=kind, factor=config.rope_scaling_factor)
    if kind == "llama3":
        params.update(original_max_position_embeddings=config.rope_original_max_position_embeddings,
                      low_freq_factor=config.rope_low_freq_factor, high_freq_factor=config.rope_high_freq_factor)
    elif kind == "yarn":
        params.update(original_max_position_embeddings=config.rope_original_max_position_embeddings,
                      beta_fast=config.yarn_beta_fast, beta_slow=config.yarn_beta_slow)
        if config.yarn_attention_factor is not None:
            params["attention_factor"] = config.yarn_attention_factor
    return params


def decoder_fields(hf, make_vocab_size_divisible_by: int, where: str) -> dict:
    """The ModelConfig fields every family shares, from a transformers config ``hf`` (no top query layer, RoPE,
    grouped-query attention when fewer key-value heads than heads, the output layer untied unless
    tie_word_embeddings; no hidden dropout: none of these classes has one on the residual stream)."""
    heads, hidden = hf.num_attention_heads, hf.hidden_size
    head_dim = getattr(hf, "head_dim", None)
    if hidden % heads or head_dim not in (None, hidden // heads):
        raise FormatError(f"{where}: head_dim {head_dim} is not hidden_size / num_attention_heads ({hidden} / "
                          f"{heads}): our attention has hidden_size / heads channels per head")
    groups = hf.num_key_value_heads or heads
    if heads % groups:
        raise FormatError(f"{where}: num_key_value_heads {groups} does not divide num_attention_heads {heads}")
    if not math.isclose(getattr(hf, "partial_rotary_factor", 1.0), 1.0):
        raise FormatError(f"{where}: partial_rotary_factor {hf.partial_rotary_factor}: only whole-head RoPE converts")
    return dict(num_layers=hf.num_hidden_layers, hidden_size=hidden, num_attention_heads=heads,
                ffn_hidden_size=hf.intermediate_size, max_position_embeddings=hf.max_position_embeddings,
                group_query_attention=groups < heads, num_query_groups=groups if groups < heads else None,
                untie_embeddings_and_output_weights=not hf.tie_word_embeddings, top_query_layer=False,
                hidden_dropout=0.0, attention_dropout=float(hf.attention_dropout),
                init_method_std=hf.initializer_range, vocab_size=hf.vocab_size,
                make_vocab_size_divisible_by=make_vocab_size_divisible_by, **rope_fields(hf.rope_parameters, where))


def is_native_decoder(config: ModelConfig) -> bool:
    """What all four classes compute: RoPE on whole heads in Llama's (GPT-NeoX's) channel pairs, no top query
    layer."""
    return (config.rope and not config.rotary_interleaved and config.rotary_percent == 1.0
            and not config.top_query_layer)


def decoder_kwargs(config: ModelConfig, architecture: str, ids: dict) -> dict:
    """The transformers config arguments every family shares (``decoder_fields`` read back)."""
    return dict(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                intermediate_size=config.ffn_hidden_size, num_hidden_layers=config.num_layers,
                num_attention_heads=config.num_attention_heads, num_key_value_heads=config.kv_groups,
                max_position_embeddings=config.max_position_embeddings, initializer_range=config.init_method_std,
                tie_word_embeddings=config.tied_output, rope_parameters=rope_parameters(config),
                attention_dropout=config.attention_dropout, architectures=[architecture], **ids)
