"""Full <-> TP-sharded state dicts and full -> pipeline stages. Pure functions.

A "full" state dict is the TP=1 model's (unpadded nothing: the word table has the padded vocabulary).
Which dimension a parameter is split along, and in how many blocks (``stride``: Q, K, V are split
separately), comes from a name table that mirrors the layers' ``partition_dim`` / ``partition_stride``
tags (a test checks the two agree).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

from codegeex_train.config.model_config import ModelConfig
from codegeex_train.tensor_parallel import shard_master_weight, split_blocks

# (name pattern, partition dim, stride); parameters matching none are replicated. A stride that depends on the
# architecture is the config's (``partition_spec``).
_PARTITIONS: tuple[tuple[str, int, int], ...] = (
    (r"word_embeddings\.weight", 0, 1),
    (r"output_layer\.weight", 0, 1),
    (r"attention\.query_key_value\.(weight|bias)", 0, 3),
    (r"attention\.query\.(weight|bias)", 0, 1),
    (r"attention\.key_value\.(weight|bias)", 0, 2),
    (r"attention\.dense\.weight", 1, 1),
    (r"mlp\.dense_h_to_4h\.(weight|bias)", 0, 1),
    (r"mlp\.dense_4h_to_h\.weight", 1, 1),
)


Stride = int | tuple[int, ...]


def partition_spec(name: str, config: ModelConfig) -> tuple[int, Stride] | None:
    """(partition_dim, stride) of a parameter of a model of ``config``, or None when every TP rank holds it whole.
    The stride is ``split_blocks``': grouped-query attention's [Q; K; V] in the proportions (heads, groups, groups),
    --swiglu's [gate; up] in two equal blocks."""
    for pattern, dim, stride in _PARTITIONS:
        if re.search(r"(^|\.)" + pattern + "$", name):
            if stride == 3 and config.kv_groups != config.num_attention_heads and name.startswith("layers."):
                return dim, (config.num_attention_heads, config.kv_groups, config.kv_groups)
            if config.swiglu and "mlp.dense_h_to_4h." in name:
                return dim, 2
            return dim, stride
    return None


def split_state_dict(full_sd: dict[str, torch.Tensor], config: ModelConfig, tp_size: int) -> list[dict]:
    """The TP=1 state dict -> one state dict per TP rank."""
    config.validate(tp_size)
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(tp_size)]
    for name, tensor in full_sd.items():
        spec = partition_spec(name, config)
        for rank in range(tp_size):
            shards[rank][name] = (tensor.clone() if spec is None
                                  else shard_master_weight(tensor, spec[0], rank, tp_size, spec[1]))
    return shards


def _merge_one(parts: list[torch.Tensor], dim: int, stride: Stride) -> torch.Tensor:
    # Each shard holds its slice of every block: block j = cat over ranks of the shard's block j.
    per_rank = [split_blocks(p, dim, stride) for p in parts]
    blocks = [torch.cat([blocks[j] for blocks in per_rank], dim=dim) for j in range(len(per_rank[0]))]
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
        spec = partition_spec(name, config)
        parts = [sd[name] for sd in shard_sds]
        full[name] = parts[0].clone() if spec is None else _merge_one(parts, *spec)
    return full


# --- Pipeline stages -----------------------------------------------------------------------------------

# Non-layer parameters and the stages that hold them: the word table is on the first stage (embedding)
# and, tied, on the last (the output layer); everything after the decoder stack is on the last (an untied model's
# output_layer too).
_FIRST_STAGE_PREFIXES = ("word_embeddings.", "position_embeddings.")
_LAST_STAGE_PREFIXES = ("final_layernorm.", "top_query_embeddings.", "top_query_layer.", "output_layer.")
_LAYER_NAME = re.compile(r"layers\.(\d+)\.")


def _check_stage_layers(stage_layers: list[Sequence[int]], num_layers: int) -> None:
    # Stage models name layers globally, so the stages must hold 0..num_layers-1 between them, each layer once, or
    # names go missing; the first stage (the embedding) starts the stack, the last (the head) ends it. (A stage's
    # layers are one range, or several chunks' under interleaved 1F1B.)
    if (not stage_layers or sorted(i for r in stage_layers for i in r) != list(range(num_layers))
            or 0 not in stage_layers[0] or num_layers - 1 not in stage_layers[-1]):
        raise ValueError(f"stage layers {[list(r) for r in stage_layers]} do not cover layers 0..{num_layers - 1} "
                         f"(--num-layers {num_layers}) each once, from the first stage to the last")


def stages_of_name(name: str, stage_layers: list[Sequence[int]], tied_output: bool = True) -> list[int]:
    """The pipeline stages (indices into ``stage_layers``) whose model has parameter ``name`` (``tied_output``: the
    config's; the word table is then on the last stage as well)."""
    last = len(stage_layers) - 1
    match = _LAYER_NAME.match(name)
    if match:
        layer = int(match.group(1))
        return [i for i, r in enumerate(stage_layers) if layer in r]
    stages = {0} if name.startswith(_FIRST_STAGE_PREFIXES) else set()
    if name.startswith(_LAST_STAGE_PREFIXES) or tied_output and name.startswith("word_embeddings."):
        stages.add(last)
    return sorted(stages)


def split_pipeline_stages(full_sd: dict[str, torch.Tensor], config: ModelConfig,
                          stage_layers: list[Sequence[int]]) -> list[dict[str, torch.Tensor]]:
    """The TP=1 state dict -> one state dict per pipeline stage, with exactly the names of
    ``CodeGeeXModel(pre_process=i == 0, post_process=i == last, layer_numbers=stage_layers[i])``.

    Tensors are shared with ``full_sd``, not copied (the word table appears on the first and last stage).
    """
    _check_stage_layers(stage_layers, config.num_layers)
    stages: list[dict[str, torch.Tensor]] = [{} for _ in stage_layers]
    for name, tensor in full_sd.items():  # full order = each stage model's order: names filter in place
        owners = stages_of_name(name, stage_layers, config.tied_output)
        if not owners:
            raise ValueError(f"parameter {name!r} belongs to no pipeline stage: not a CodeGeeXModel state dict "
                             f"with --num-layers {config.num_layers}")
        for i in owners:
            stages[i][name] = tensor
    return stages


def split_model_parallel(full_sd: dict[str, torch.Tensor], config: ModelConfig, tp_size: int,
                         stage_layers: list[Sequence[int]]) -> list[dict[str, torch.Tensor]]:
    """The TP=1 state dict -> one state dict per model-parallel rank, in checkpoint (MP) order
    (``layout.dims.model_parallel_rank``: PP outer, TP inner), each a copy."""
    return [shard for stage in split_pipeline_stages(full_sd, config, stage_layers)
            for shard in split_state_dict(stage, config, tp_size)]
