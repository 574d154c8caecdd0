"""Full <-> TP-sharded state dicts, full -> pipeline stages, and Hugging Face GPT-2 <-> our full state
dict. Pure functions.

A "full" state dict is the TP=1 model's (unpadded nothing: the word table has the padded vocabulary).
Which dimension a parameter is split along, and in how many blocks (``stride``: Q, K, V are split
separately), comes from a name table that mirrors the layers' ``partition_dim`` / ``partition_stride``
tags (a test checks the two agree).
"""

from __future__ import annotations

import re

import torch

from ..tensor_parallel import shard_master_weight
from .config import ModelConfig

# (name pattern, partition dim, stride); parameters matching none are replicated.
_PARTITIONS: tuple[tuple[str, int, int], ...] = (
    (r"word_embeddings\.weight", 0, 1),
    (r"attention\.query_key_value\.(weight|bias)", 0, 3),
    (r"attention\.query\.(weight|bias)", 0, 1),
    (r"attention\.key_value\.(weight|bias)", 0, 2),
    (r"attention\.dense\.weight", 1, 1),
    (r"mlp\.dense_h_to_4h\.(weight|bias)", 0, 1),
    (r"mlp\.dense_4h_to_h\.weight", 1, 1),
)


def partition_spec(name: str) -> tuple[int, int] | None:
    """(partition_dim, stride) of a parameter, or None when every TP rank holds it whole."""
    for pattern, dim, stride in _PARTITIONS:
        if re.search(r"(^|\.)" + pattern + "$", name):
            return dim, stride
    return None


def split_state_dict(full_sd: dict[str, torch.Tensor], config: ModelConfig, tp_size: int) -> list[dict]:
    """The TP=1 state dict -> one state dict per TP rank."""
    config.validate(tp_size)
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(tp_size)]
    for name, tensor in full_sd.items():
        spec = partition_spec(name)
        for rank in range(tp_size):
            shards[rank][name] = (tensor.clone() if spec is None
                                  else shard_master_weight(tensor, spec[0], rank, tp_size, spec[1]))
    return shards


def _merge_one(parts: list[torch.Tensor], dim: int, stride: int) -> torch.Tensor:
    # Each shard holds its slice of every block: block j = cat over ranks of shard.chunk(stride)[j].
    blocks = [torch.cat([p.chunk(stride, dim=dim)[j] for p in parts], dim=dim) for j in range(stride)]
    return torch.cat(blocks, dim=dim)


def merge_state_dicts(shard_sds: list[dict[str, torch.Tensor]], config: ModelConfig) -> dict[str, torch.Tensor]:
    """One state dict per TP rank (rank order) -> the TP=1 state dict. Inverse of split_state_dict."""
    config.validate(len(shard_sds))
    names = list(shard_sds[0])
    for rank, sd in enumerate(shard_sds[1:], start=1):
        if list(sd) != names:
            raise ValueError(f"TP rank {rank} has parameters {sorted(set(sd) ^ set(names))} that rank 0 "
                             f"does not (or the reverse): not shards of one model")
    full = {}
    for name in names:
        spec = partition_spec(name)
        parts = [sd[name] for sd in shard_sds]
        full[name] = parts[0].clone() if spec is None else _merge_one(parts, *spec)
    return full


# --- Pipeline stages -----------------------------------------------------------------------------------

# Non-layer parameters and the stages that hold them: the word table is on the first stage (embedding)
# and the last (tied output layer); everything after the decoder stack is on the last.
_FIRST_STAGE_PREFIXES = ("word_embeddings.", "position_embeddings.")
_LAST_STAGE_PREFIXES = ("word_embeddings.", "final_layernorm.", "top_query_embeddings.", "top_query_layer.")
_LAYER_NAME = re.compile(r"layers\.(\d+)\.")


def _check_stage_layers(stage_layers: list[range], num_layers: int) -> None:
    # Stage models name layers globally, so the ranges must tile 0..num_layers-1 in order, or names go missing.
    if not stage_layers or [i for r in stage_layers for i in r] != list(range(num_layers)):
        raise ValueError(f"stage layer ranges {[(r.start, r.stop) for r in stage_layers]} do not cover layers "
                         f"0..{num_layers - 1} (--num-layers {num_layers}) in order, each once")


def stages_of_name(name: str, stage_layers: list[range]) -> list[int]:
    """The pipeline stages (indices into ``stage_layers``) whose model has parameter ``name``."""
    last = len(stage_layers) - 1
    match = _LAYER_NAME.match(name)
    if match:
        layer = int(match.group(1))
        return [i for i, r in enumerate(stage_layers) if layer in r]
    stages = {0} if name.startswith(_FIRST_STAGE_PREFIXES) else set()
    if name.startswith(_LAST_STAGE_PREFIXES):
        stages.add(last)
    return sorted(stages)


def split_pipeline_stages(full_sd: dict[str, torch.Tensor], config: ModelConfig,
                          stage_layers: list[range]) -> list[dict[str, torch.Tensor]]:
    """The TP=1 state dict -> one state dict per pipeline stage, with exactly the names of
    ``CodeGeeXModel(pre_process=i == 0, post_process=i == last, layer_numbers=stage_layers[i])``.

    Tensors are shared with ``full_sd``, not copied (the word table appears on the first and last stage).
    """
    _check_stage_layers(stage_layers, config.num_layers)
    stages: list[dict[str, torch.Tensor]] = [{} for _ in stage_layers]
    for name, tensor in full_sd.items():  # full order = each stage model's order: names filter in place
        owners = stages_of_name(name, stage_layers)
        if not owners:
            raise ValueError(f"parameter {name!r} belongs to no pipeline stage: not a CodeGeeXModel state dict "
                             f"with --num-layers {config.num_layers}")
        for i in owners:
            stages[i][name] = tensor
    return stages


def split_model_parallel(full_sd: dict[str, torch.Tensor], config: ModelConfig, tp_size: int,
                         stage_layers: list[range]) -> list[dict[str, torch.Tensor]]:
    """The TP=1 state dict -> one state dict per model-parallel rank, in checkpoint (MP) order:
    ``pp_rank * tp_size + tp_rank``, each a copy."""
    return [shard for stage in split_pipeline_stages(full_sd, config, stage_layers)
            for shard in split_state_dict(stage, config, tp_size)]


# --- Hugging Face GPT-2 -------------------------------------------------------------------------------

# Our per-layer name -> GPT-2's (transformer.h.{i}.) name, and whether HF's Conv1D stores it (in, out).
_LAYER_MAP: tuple[tuple[str, str, bool], ...] = (
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
        for ours, theirs, conv1d in _LAYER_MAP:
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
        for ours, theirs, conv1d in _LAYER_MAP:
            t = full_sd[f"layers.{i}.{ours}"]
            hf[f"transformer.h.{i}.{theirs}"] = t.t() if conv1d else t
    hf["transformer.ln_f.weight"] = full_sd["final_layernorm.weight"]
    hf["transformer.ln_f.bias"] = full_sd["final_layernorm.bias"]
    hf["lm_head.weight"] = wte
    return {k: v.detach().clone().contiguous() for k, v in hf.items()}
