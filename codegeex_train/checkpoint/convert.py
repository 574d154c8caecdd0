"""Our checkpoint between model-parallel layouts: the written ``Layout``, writing a model at a layout, re-splitting a
checkpoint, and reading one back tensor by tensor (what the exports and imports stream through).

Nothing here holds the whole model twice: ``open_full_tensors`` maps the rank files (weights-only, ``safe_load.py``)
and merges a tensor across the TP ranks when asked for it; ``save_at_layout`` builds each rank's file from such a
source when that file is written, so at most one rank's tensors are in memory besides the source.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from codegeex_train.checkpoint.files import (
    CheckpointError,
    rank_parameter_shapes,
    read_checkpoint_meta,
    read_model_file,
    save_model_checkpoint,
    shard_file,
)
from codegeex_train.checkpoint.sharding import merge_state_dicts, partition_spec
from codegeex_train.config.model_config import ModelConfig
from codegeex_train.layout.stages import (
    chunked_stage_layers,
    rank_chunk_layers,
    stage_layer_ranges,
    virtual_pipeline_size,
)
from codegeex_train.tensor_parallel import shard_master_weight

TensorSource = Callable[[str], torch.Tensor]  # our parameter name -> its full (TP = 1) tensor


class Layout(NamedTuple):  # not a dataclass: tests load the tool re-exporting it as a module outside sys.modules
    """The model-parallel layout of a written checkpoint: TP size, PP size, the uneven-split flags and the layers
    per virtual stage (interleaved 1F1B)."""

    tp_size: int = 1
    pp_size: int = 1
    first: int | None = None
    last: int | None = None
    layers_per_virtual_stage: int | None = None

    def num_chunks(self, config: ModelConfig) -> int:
        return virtual_pipeline_size(config.num_layers, self.pp_size, self.layers_per_virtual_stage, self.first,
                                     self.last)

    def stage_layers(self, config: ModelConfig) -> list:
        """Each stage's layers (all its chunks'); checks TP and the split against ``config`` before any weight is
        read."""
        config.validate(self.tp_size)
        v = self.num_chunks(config)
        if v > 1:
            return list(chunked_stage_layers(rank_chunk_layers(config.num_layers, self.pp_size, v)))
        return stage_layer_ranges(config.num_layers, self.pp_size, self.first, self.last)


def _owned(t: torch.Tensor) -> torch.Tensor:
    """``t`` if it is the whole of its own storage (torch.save writes a view's whole storage), else a copy."""
    whole = t.is_contiguous() and t.storage_offset() == 0 and (
        t.untyped_storage().nbytes() == t.numel() * t.element_size())
    return t if whole else t.clone()


class _RankFiles(Sequence):
    """The state dict of each model-parallel rank (MP order), built from ``source`` when indexed: what
    ``save_model_checkpoint`` writes one after the other."""

    def __init__(self, source: TensorSource, config: ModelConfig, layout: Layout) -> None:
        self.source, self.config, self.tp = source, config, layout.tp_size
        self.stage_layers = layout.stage_layers(config)

    def __len__(self) -> int:
        return self.tp * len(self.stage_layers)

    def __getitem__(self, mp_rank: int) -> dict[str, torch.Tensor]:
        if not 0 <= mp_rank < len(self):
            raise IndexError(mp_rank)
        tp_rank, pp_rank = mp_rank % self.tp, mp_rank // self.tp
        names = rank_parameter_shapes(self.config, self.tp, self.stage_layers, pp_rank)  # CodeGeeXModel's order
        sd = {}
        for name in names:
            try:
                full = self.source(name)
            except KeyError:
                raise CheckpointError(f"the model to write has no parameter {name}, which a model of its config "
                                      f"(--num-layers {self.config.num_layers}, ...) has: not a whole model") from None
            spec = partition_spec(name, self.config)
            sd[name] = _owned(full) if spec is None else shard_master_weight(full, spec[0], tp_rank, self.tp, spec[1])
        return sd


def save_at_layout(save_dir: str | os.PathLike, source: TensorSource, config: ModelConfig, layout: Layout,
                   **save_kwargs) -> None:
    """Write the model whose full tensors ``source`` gives (a full state dict's ``__getitem__``, or
    ``open_full_tensors``') as a checkpoint at ``layout``, one rank's file at a time (``save_kwargs``:
    ``save_model_checkpoint``'s iteration, tag, tokenizer)."""
    ranks = _RankFiles(source, config, layout)  # checks the layout first
    save_model_checkpoint(save_dir, ranks, config, layout.tp_size, pp_size=layout.pp_size,
                          num_chunks=layout.num_chunks(config), **save_kwargs)


class FullTensors(NamedTuple):
    """A checkpoint opened for streaming: its config and metadata, its parameter names (each once) and
    ``get(name)``: that full tensor, merged across the TP ranks from the mapped files (a new tensor)."""

    config: ModelConfig
    meta: dict
    names: list[str]
    get: TensorSource


# The rank files are mapped again after this many bytes were merged from them: the pages read so far leave this
# process's resident memory (the page cache keeps them): an export holds about this plus one shard.
REMAP_BYTES = 256 << 20


def open_full_tensors(load_dir: str | os.PathLike) -> FullTensors:
    """``load_dir``'s latest checkpoint at any TP / PP, its rank files memory-mapped (nothing merged yet)."""
    tag, meta = read_checkpoint_meta(load_dir)
    config = ModelConfig(**meta["model_config"])
    tp, pp = meta["tp_size"], meta["pp_size"]
    files = [[shard_file(load_dir, tag, r, tp, pp_rank) for r in range(tp)] for pp_rank in range(pp)]
    mapped: dict[int, list[dict]] = {}  # pp_rank -> its TP ranks' state dicts, mapped

    def stage(pp_rank: int) -> list[dict]:
        if pp_rank not in mapped:
            mapped[pp_rank] = [read_model_file(path)["module"] for path in files[pp_rank]]
        return mapped[pp_rank]

    owner: dict[str, int] = {}  # name -> the first stage holding it (the tied word table: the first stage's copy)
    for pp_rank in range(pp):
        for name in stage(pp_rank)[0]:
            owner.setdefault(name, pp_rank)
    merged_bytes = 0

    def get(name: str) -> torch.Tensor:
        nonlocal merged_bytes
        full = merge_state_dicts([{name: sd[name]} for sd in stage(owner[name])], config)[name]
        merged_bytes += full.numel() * full.element_size()
        if merged_bytes > REMAP_BYTES:  # nothing else refers to the mapped tensors: this unmaps them
            mapped.clear()
            merged_bytes = 0
        return full

    return FullTensors(config, meta, list(owner), get)


def reshard(load_dir: str, save_dir: str, layout: Layout) -> None:
    """Re-split ``load_dir``'s latest checkpoint (any layout) for ``layout``, keeping its iteration and tokenizer."""
    _, meta = read_checkpoint_meta(load_dir)  # metadata only: a bad split fails before the weights are mapped
    layout.stage_layers(ModelConfig(**meta["model_config"]))
    source = open_full_tensors(load_dir)
    iteration = source.meta["iteration"]
    save_at_layout(save_dir, source.get, source.config, layout, iteration=iteration, tag=f"iter_{iteration:07d}",
                   tokenizer=source.meta.get("tokenizer"))
