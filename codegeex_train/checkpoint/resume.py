"""Where a run starts: ``--load`` checked before any process group (``preflight_resume``), then restored in one
call (``restore``).

A ``--load`` directory holds one of three kinds of checkpoint (``ResumeKind``):

* TRAINING: saved by a run at this TP / PP / DP layout: model, ZeRO optimizer partitions, LR schedule,
  counters and RNG streams, all restored by DeepSpeed's ``load_checkpoint``;
* UNIVERSAL: layout-free (``checkpoint/universal.py``): weights and Adam moments split for this layout;
* WEIGHTS: model weights only (converted from Hugging Face or CodeGeeX, or re-sharded): the training state
  starts afresh.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from typing import Callable

import torch

from codegeex_train.checkpoint.files import (
    CheckpointError,
    describe_shape_difference,
    load_model_checkpoint,
    read_checkpoint_meta,
    read_latest,
)
from codegeex_train.checkpoint.safe_load import verify_checkpoint_dir
from codegeex_train.checkpoint.train_state import TrainState
from codegeex_train.checkpoint.training import has_optimizer_states, load_checkpoint
from codegeex_train.checkpoint.universal import (
    is_universal,
    load_universal_training_state,
    load_universal_weights,
    read_universal_meta,
)
from codegeex_train.config.arguments import ConfigError
from codegeex_train.config.model import ModelConfig
from codegeex_train.distributed.topology import ParallelDims, Topology
from codegeex_train.pipeline import sync_shared_embedding
from codegeex_train.tensor_parallel import RNGStatesTracker


class ResumeKind(enum.Enum):
    TRAINING = "training"
    UNIVERSAL = "universal"
    WEIGHTS = "weights"


@dataclass(frozen=True)
class Resume:
    """A checked ``--load``: its directory, the tag ``latest`` names, what kind it is, its metadata."""

    load_dir: str
    tag: str
    kind: ResumeKind
    meta: dict


_TO_UNIVERSAL = ("to resume at another layout, convert it first: python tools/convert_checkpoint.py --load {d} "
                 "--to-universal OUT, then --load OUT")


def _check_same_model(load_dir: str, tag: str, meta: dict, config: ModelConfig) -> None:
    diff = describe_shape_difference(ModelConfig(**meta["model_config"]), config)
    if diff:
        raise ConfigError(f"--load {load_dir} ({tag}) was saved from a different model ({diff}): use the same "
                          f"model flags")


def _saved_dp_size(load_dir: str, tag: str) -> int:
    """ZeRO partitions the optimizer state by DP rank: one file per DP rank of model-parallel rank 0."""
    return sum(name.startswith(("zero_pp_rank_", "bf16_zero_pp_rank_")) and "_mp_rank_00_" in name
               for name in os.listdir(os.path.join(load_dir, tag)))


def preflight_resume(load_dir: str, config: ModelConfig, dims: ParallelDims) -> Resume:
    """Check ``--load`` before any process group: a complete checkpoint of this model shape, saved at this
    run's TP / PP / DP sizes, or a universal one (any layout), or model weights at this TP / PP size."""
    try:
        tag = read_latest(load_dir)
        verify_checkpoint_dir(load_dir, tag)  # weights-only, before DeepSpeed unpickles any of its files
        if is_universal(load_dir, tag):
            meta = read_universal_meta(load_dir, tag)
            _check_same_model(load_dir, tag, meta, config)
            return Resume(load_dir, tag, ResumeKind.UNIVERSAL, meta)
        tag, meta = read_checkpoint_meta(load_dir)
    except CheckpointError as e:
        raise ConfigError(f"--load {load_dir}: {e}") from None
    _check_same_model(load_dir, tag, meta, config)
    kind = ResumeKind.TRAINING if has_optimizer_states(load_dir, tag) else ResumeKind.WEIGHTS
    saved = {"TP": meta["tp_size"], "PP": meta["pp_size"]}
    if kind is ResumeKind.TRAINING:
        saved["DP"] = _saved_dp_size(load_dir, tag)
    ours = {"TP": dims.tp_size, "PP": dims.pp_size, "DP": dims.dp_size}
    diff = [k for k in saved if saved[k] != ours[k]]
    if diff:
        layout = ", ".join(f"{k} {saved[k]} (this run {ours[k]})" for k in diff)
        hint = _TO_UNIVERSAL.format(d=load_dir) if "DP" in saved else (
            "tools/convert_checkpoint.py re-shards these model weights to another TP and PP size")
        raise ConfigError(f"--load {load_dir} ({tag}) was saved at another parallel layout: {layout}; {hint}")
    return Resume(load_dir, tag, kind, meta)


def restore(resume: Resume | None, model: torch.nn.Module, topology: Topology, tracker: RNGStatesTracker,
            stage_layers: tuple[range, ...], build_engine: Callable[[torch.nn.Module], object]):
    """Build the engine around ``model`` with ``build_engine`` and bring both to where ``resume`` left off (or to
    a fresh start); returns ``(engine, TrainState)``.

    Weights that come without a ZeRO optimizer (universal, weights-only) go into the model before the engine is
    built, so that ZeRO builds its fp32 master copies from them, exactly; a training checkpoint is loaded into
    the built engine. Last, the tied output layer (last stage) takes the first stage's word embedding, in the
    model and in its fp32 master copy."""
    kind = resume.kind if resume is not None else None
    if kind is ResumeKind.UNIVERSAL:
        load_universal_weights(model, resume.load_dir, resume.tag, pp_rank=topology.pp_rank,
                               stage_layers=stage_layers)
    elif kind is ResumeKind.WEIGHTS:
        load_model_checkpoint(resume.load_dir, model, pp_size=topology.pp_size, pp_rank=topology.pp_rank)
    engine = build_engine(model)
    if kind is ResumeKind.UNIVERSAL:
        state = load_universal_training_state(engine, resume.load_dir, resume.tag, pp_rank=topology.pp_rank,
                                              stage_layers=stage_layers)
    elif kind is ResumeKind.TRAINING:
        state = load_checkpoint(engine, resume.load_dir, resume.tag, tracker)
    else:
        state = TrainState()
    sync_shared_embedding(engine.module, topology)
    return engine, state
