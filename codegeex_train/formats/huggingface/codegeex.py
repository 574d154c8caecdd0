"""Hugging Face CodeGeeX (remote code: remote/) <-> our full (TP=1) state dict and config. Pure functions.

    json.dump(hf_codegeex_config(config, eos_token_id=tok.eod), open(out / "config.json", "w"))
    copy_remote_code(out)                                   # the module files sit next to config.json
    for name, tensor in full.items():                       # streaming: one tensor at a time
        for hf_name, hf_tensor in to_hf_tensor(name, tensor, config): ...

Every model this stack trains exports this way; those ``is_gpt2_shaped`` (no top query layer, gelu_tanh, learned
positions) also export as a plain ``GPT2LMHeadModel`` (gpt2.py). The HF parameter names are ours under
``transformer.`` (remote/modeling_codegeex.py keeps our module tree and our [Q; K; V] layout), so the map is a
prefix, the word table trimmed to the tokenizer's vocabulary (zero-padded back on import), and the tied
``lm_head.weight`` left out (transformers ties it on load; an import ignores it).
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from codegeex_train.model.shapes import model_parameter_shapes
from codegeex_train.config.model_config import ModelConfig

_REMOTE_DIR = Path(__file__).resolve().parent / "remote"
REMOTE_CODE_FILES: tuple[Path, ...] = (_REMOTE_DIR / "configuration_codegeex.py", _REMOTE_DIR / "modeling_codegeex.py")
AUTO_MAP = {"AutoConfig": "configuration_codegeex.CodeGeeXConfig",
            "AutoModelForCausalLM": "modeling_codegeex.CodeGeeXForCausalLM"}
PREFIX = "transformer."
WORD_EMBEDDINGS = "word_embeddings.weight"
LM_HEAD = "lm_head.weight"  # tied to the word table: never written, ignored when read

_LAYER_PARAMS = ("input_layernorm", "attention.dense", "post_attention_layernorm", "mlp.dense_h_to_4h",
                 "mlp.dense_4h_to_h")


def is_gpt2_shaped(config: ModelConfig) -> bool:
    """A model GPT2LMHeadModel computes: no top query layer, GPT-2's gelu_new, learned positions."""
    return not config.top_query_layer and config.activation == "gelu_tanh" and not config.rope


def full_names(config: ModelConfig) -> list[str]:
    """Our TP=1 parameter names of a model of this shape, in model order."""
    def layer(prefix: str, attention: tuple[str, ...]) -> list[str]:
        modules = (_LAYER_PARAMS[0], *attention, *_LAYER_PARAMS[1:])
        return [f"{prefix}{m}.{p}" for m in modules for p in ("weight", "bias")]

    names = [WORD_EMBEDDINGS] + ([] if config.rope else ["position_embeddings.weight"])
    for i in range(config.num_layers):
        names += layer(f"layers.{i}.", ("attention.query_key_value",))
    names += ["final_layernorm.weight", "final_layernorm.bias"]
    if config.top_query_layer:
        names += ["top_query_embeddings.weight"]
        names += layer("top_query_layer.", ("attention.query", "attention.key_value"))
    return names


def hf_codegeex_config(config: ModelConfig, *, bos_token_id: int | None = None, eos_token_id: int | None = None,
                       pad_token_id: int | None = None) -> dict:
    """config.json of the export: CodeGeeXConfig's fields, ``auto_map`` to the remote code, the tokenizer's
    (unpadded) vocabulary and special token ids."""
    return {
        "model_type": "codegeex",
        "architectures": ["CodeGeeXForCausalLM"],
        "auto_map": dict(AUTO_MAP),
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "ffn_hidden_size": config.ffn_hidden_size,
        "max_position_embeddings": config.max_position_embeddings,
        "position_embedding_type": config.position_embedding_type,
        "rotary_percent": config.rotary_percent,
        "rotary_base": config.rotary_base,
        "rotary_interleaved": config.rotary_interleaved,
        "activation": config.activation,
        "top_query_layer": config.top_query_layer,
        "layernorm_epsilon": config.layernorm_epsilon,
        "hidden_dropout": config.hidden_dropout,
        "attention_dropout": config.attention_dropout,
        "initializer_range": config.init_method_std,
        "tie_word_embeddings": True,
        "use_cache": True,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
    }


def _config_field_types() -> dict[str, str]:
    """config.json's model fields (``hf_codegeex_config``'s) -> their ModelConfig type ('int', 'int | None', ...)."""
    declared = {f.name: f.type for f in dataclasses.fields(ModelConfig)}
    ours = {"initializer_range": "init_method_std"}
    return {key: declared[ours.get(key, key)] for key in hf_codegeex_config(ModelConfig(vocab_size=1))
            if ours.get(key, key) in declared}


CONFIG_FIELD_TYPES = _config_field_types()


def hf_codegeex_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The export's tensors (``transformer.`` names, no tied lm_head) with the shapes ``config`` implies (the word
    table unpadded)."""
    shapes = {PREFIX + name: shape for name, shape in model_parameter_shapes(config).items()}
    shapes[PREFIX + WORD_EMBEDDINGS] = (config.vocab_size, config.hidden_size)
    return shapes


def config_from_hf_codegeex(d: Mapping, make_vocab_size_divisible_by: int = 128) -> ModelConfig:
    """Our ModelConfig from an export's config.json (a dict); the padded vocabulary is ours to choose."""
    if d.get("model_type") != "codegeex":
        raise ValueError(f"config.json has model_type {d.get('model_type')!r}, not 'codegeex': not a CodeGeeX export "
                         f"(a GPT-2 one reads with hf_gpt2.config_from_hf_gpt2)")
    config = ModelConfig(
        num_layers=d["num_layers"], hidden_size=d["hidden_size"], num_attention_heads=d["num_attention_heads"],
        ffn_hidden_size=d.get("ffn_hidden_size"), max_position_embeddings=d["max_position_embeddings"],
        position_embedding_type=d.get("position_embedding_type", "learned_absolute"),
        rotary_percent=d.get("rotary_percent", 1.0), rotary_base=d.get("rotary_base", 10000),
        rotary_interleaved=d.get("rotary_interleaved", False),
        make_vocab_size_divisible_by=make_vocab_size_divisible_by, hidden_dropout=d.get("hidden_dropout", 0.0),
        attention_dropout=d.get("attention_dropout", 0.0), layernorm_epsilon=d.get("layernorm_epsilon", 1e-5),
        activation=d["activation"], top_query_layer=d["top_query_layer"],
        init_method_std=d.get("initializer_range", 0.02), vocab_size=d["vocab_size"])
    config.validate()
    return config


def to_hf_tensor(name: str, tensor: torch.Tensor, config: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    """One of our TP=1 tensors -> its (hf_name, tensor) entries (the word table trimmed to the real vocabulary; a
    view, no copy)."""
    if name == WORD_EMBEDDINGS:
        tensor = tensor[: config.vocab_size]  # (V, h): the padding rows stay behind
    return [(PREFIX + name, tensor)]


def from_hf_tensor(hf_name: str, tensor: torch.Tensor, config: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    """One tensor of an export -> our (name, tensor) entries: none for the tied lm_head, the word table zero-padded
    to the padded vocabulary."""
    if hf_name == LM_HEAD:
        return []
    if not hf_name.startswith(PREFIX):
        raise ValueError(f"{hf_name!r} is not a CodeGeeX export's tensor (they are named {PREFIX}...)")
    name = hf_name.removeprefix(PREFIX)
    if name == WORD_EMBEDDINGS:
        if tensor.shape[0] != config.vocab_size:
            raise ValueError(f"{hf_name} has {tensor.shape[0]} rows but config.json's vocab_size is "
                             f"{config.vocab_size}")
        padding = tensor.new_zeros(config.padded_vocab_size - tensor.shape[0], tensor.shape[1])
        tensor = torch.cat([tensor, padding])  # (padded V, h)
    return [(name, tensor)]


def _check_names(have: Iterable[str], config: ModelConfig, what: str) -> None:
    have, want = set(have), set(full_names(config))
    if have != want:
        raise ValueError(f"{what} does not match the config: missing {sorted(want - have)[:5]}, "
                         f"unexpected {sorted(have - want)[:5]}")


def full_to_hf_codegeex(full: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Our TP=1 state dict -> the export's state dict (``to_hf_tensor`` on each; contiguous, ready for safetensors)."""
    _check_names(full, config, "the state dict")
    return {hf: t.contiguous() for name in full_names(config) for hf, t in to_hf_tensor(name, full[name], config)}


def hf_codegeex_to_full(hf_sd: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """An export's state dict -> our TP=1 state dict (``from_hf_tensor`` on each)."""
    full = {name: t for hf_name, tensor in hf_sd.items() for name, t in from_hf_tensor(hf_name, tensor, config)}
    _check_names(full, config, "the Hugging Face state dict")
    return {name: full[name].contiguous() for name in full_names(config)}


def copy_remote_code(out_dir: str | Path) -> list[Path]:
    """Copy the remote-code modules into ``out_dir``, beside config.json, where transformers looks for them."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    copied = []
    for source in REMOTE_CODE_FILES:
        shutil.copyfile(source, out_dir / source.name)
        copied.append(out_dir / source.name)
    return copied
