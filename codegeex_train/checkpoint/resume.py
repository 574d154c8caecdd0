"""Where a run starts: ``--load`` checked before any process group (``preflight_resume``), then restored in one
call (``restore``).

A ``--load`` directory holds one of three kinds of checkpoint (``ResumeKind``):

* TRAINING: saved by a run at this TP / PP / DP layout: model, ZeRO optimizer partitions, LR schedule,
  counters and RNG streams, all restored by DeepSpeed's ``load_checkpoint``;
* UNIVERSAL: layout-free (``checkpoint/universal.py``): weights and Adam moments split for this layout;
* WEIGHTS: model weights only (converted from Hugging Face or CodeGeeX, or re-sharded): the training state
  starts afresh.

What is restored from it (``preflight_load`` reads the flags), as Megatron-LM's flags mean:

* ``--finetune``: the model weights only, of any kind; the iteration, consumed samples, optimizer and LR schedule
  start afresh and the RNG streams from --seed. The weights go into the model before the engine is built, so
  ZeRO's fp32 masters are built from them. A relaunch of the same command resumes instead: when --save already
  holds a checkpoint, that one is restored in full and --load is ignored (rank 0 prints one line saying so);
* ``--no-load-optim``: everything but the optimizer state (Adam's moments and step start afresh): the iteration,
  consumed samples and LR schedule continue (as under Megatron-DeepSpeed; Megatron-LM's own ``torch`` checkpoints
  also leave the LR schedule fresh here, because it is stored with the optimizer). ZeRO's fp32 master partitions
  are rebuilt from the loaded weights (see ``training.load_checkpoint``). A training checkpoint saved at another DP
  size loads too (the DP size only cuts the optimizer files);
* ``--no-load-rng``: everything but the RNG streams, which start from --seed.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from dataclasses import dataclass
from typing import Callable

import torch

from codegeex_train.checkpoint.deepspeed_files import check_training_files
from codegeex_train.checkpoint.files import (
    CheckpointError,
    describe_shape_difference,
    load_model_checkpoint,
    read_checkpoint_meta,
    read_latest,
    saved_num_chunks,
    type_name,
)
from codegeex_train.checkpoint.safe_load import verify_checkpoint_dir
from codegeex_train.checkpoint.train_state import TrainState
from codegeex_train.checkpoint.training import has_optimizer_states, load_checkpoint
from codegeex_train.checkpoint.universal import (
    check_universal_tensors,
    is_universal,
    load_universal_training_state,
    load_universal_weights,
    read_universal_meta,
)
from codegeex_train.config.arguments import ConfigError, TrainConfig
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
    """A checked ``--load``: its directory, the tag ``latest`` names, what kind it is, its metadata; and what of it
    to restore."""

    load_dir: str
    tag: str
    kind: ResumeKind
    meta: dict
    finetune: bool = False  # --finetune: the model weights only; counters, optimizer, LR schedule, RNG afresh
    load_optim: bool = True  # False: --no-load-optim
    load_rng: bool = True  # False: --no-load-rng
    note: str | None = None  # printed once (rank 0) when restoring, e.g. why --save is resumed instead of --load


_TO_UNIVERSAL = ("to resume at another layout, convert it first: python tools/convert_checkpoint.py --load {d} "
                 "--to-universal OUT, then --load OUT")


def _check_same_model(load_dir: str, tag: str, meta: dict, config: ModelConfig) -> None:
    diff = describe_shape_difference(ModelConfig(**meta["model_config"]), config)
    if diff:
        raise ConfigError(f"--load {load_dir} ({tag}) was saved from a different model ({diff}): use the same "
                          f"model flags")


def _check_train_state(load_dir: str, tag: str, state: object) -> None:
    """The training state a resume restores (``TrainState``, RNG streams as tensors), checked for its types."""
    where = f"{load_dir}/{tag}/mp_rank_00_model_states.pt: train_state"
    fields = {f.name for f in dataclasses.fields(TrainState)}
    if not isinstance(state, dict) or not set(state) <= fields or not {"iteration", "consumed_train_samples",
                                                                       "rng"} <= set(state):
        raise CheckpointError(f"{where} is not a training state (the fields of TrainState)")
    for key in ("iteration", "consumed_train_samples"):
        if type(state[key]) is not int or state[key] < 0:
            raise CheckpointError(f"{where}: {key} is {type_name(state[key])}, not an integer >= 0")
    run_id = state.get("wandb_run_id")
    if run_id is not None and not isinstance(run_id, str):
        raise CheckpointError(f"{where}: wandb_run_id is {type_name(run_id)}, not a string")
    rng = state["rng"]
    if not (isinstance(rng, dict) and isinstance(rng.get("cpu"), torch.Tensor) and isinstance(rng.get("tracker"), dict)
            and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in rng["tracker"].items())):
        raise CheckpointError(f"{where}: rng is not the random-number states (tensors under 'cpu' and 'tracker')")


def _saved_dp_size(load_dir: str, tag: str) -> int:
    """ZeRO partitions the optimizer state by DP rank: one file per DP rank of model-parallel rank 0."""
    return sum(name.startswith(("zero_pp_rank_", "bf16_zero_pp_rank_")) and "_mp_rank_00_" in name
               for name in os.listdir(os.path.join(load_dir, tag)))


def preflight_resume(load_dir: str, config: ModelConfig, dims: ParallelDims, *, finetune: bool = False,
                     load_optim: bool = True, load_rng: bool = True, num_chunks: int = 1) -> Resume:
    """Check ``--load`` before any process group: a complete checkpoint of this model shape, saved at this
    run's TP / PP / DP sizes, or a universal one (any layout), or model weights at this TP / PP size. The DP size
    matters only when the ZeRO optimizer partitions are loaded (not under ``finetune`` or without ``load_optim``)."""
    flags = {"finetune": finetune, "load_optim": load_optim, "load_rng": load_rng}
    try:
        tag = read_latest(load_dir)
        verify_checkpoint_dir(load_dir, tag)  # weights-only, before DeepSpeed unpickles any of its files
        if is_universal(load_dir, tag):
            meta = read_universal_meta(load_dir, tag)
            check_universal_tensors(load_dir, tag)
            _check_same_model(load_dir, tag, meta, config)
            return Resume(load_dir, tag, ResumeKind.UNIVERSAL, meta, **flags)
        tag, meta = read_checkpoint_meta(load_dir)
    except CheckpointError as e:
        raise ConfigError(f"--load {load_dir}: {e}") from None
    _check_same_model(load_dir, tag, meta, config)
    kind = ResumeKind.TRAINING if has_optimizer_states(load_dir, tag) else ResumeKind.WEIGHTS
    if kind is ResumeKind.TRAINING and not finetune:  # what DeepSpeed will index, checked before it does
        try:
            _check_train_state(load_dir, tag, meta.get("train_state"))
            check_training_files(load_dir, tag, meta["tp_size"] * meta["pp_size"], optimizer=load_optim)
        except CheckpointError as e:
            raise ConfigError(f"--load {load_dir}: {e}") from None
    # v: each rank's file holds its chunks' layers, which v changes
    saved = {"TP": meta["tp_size"], "PP": meta["pp_size"], "virtual pipeline chunks per rank": saved_num_chunks(meta)}
    if kind is ResumeKind.TRAINING and load_optim and not finetune:
        saved["DP"] = _saved_dp_size(load_dir, tag)
    ours = {"TP": dims.tp_size, "PP": dims.pp_size, "DP": dims.dp_size, "virtual pipeline chunks per rank": num_chunks}
    diff = [k for k in saved if saved[k] != ours[k]]
    if diff:
        layout = ", ".join(f"{k} {saved[k]} (this run {ours[k]})" for k in diff)
        hint = _TO_UNIVERSAL.format(d=load_dir) if "DP" in saved else (
            "tools/convert_checkpoint.py re-shards these model weights to another TP and PP size (and "
            "--num-layers-per-virtual-pipeline-stage)")
        raise ConfigError(f"--load {load_dir} ({tag}) was saved at another parallel layout: {layout}; {hint}")
    return Resume(load_dir, tag, kind, meta, **flags)


def preflight_load(train: TrainConfig, config: ModelConfig, dims: ParallelDims, num_chunks: int = 1) -> Resume | None:
    """What this run starts from, checked before any process group: None (a fresh start), or ``--load`` with
    what to restore of it (--finetune, --no-load-optim, --no-load-rng); under --finetune, --save instead when it
    already holds a checkpoint (a relaunch). Nonsense combinations raise ConfigError naming the flags."""
    t = train
    if t.load is None:
        if t.finetune or t.no_load_optim or t.no_load_rng:
            given = " ".join(flag for flag, on in (("--finetune", t.finetune), ("--no-load-optim", t.no_load_optim),
                                                   ("--no-load-rng", t.no_load_rng)) if on)
            raise ConfigError(f"{given} without --load: they say what to take from the checkpoint --load names; pass "
                              f"--load CHECKPOINT_DIR (for --finetune: a training, universal or weights-only one), or "
                              f"drop {given} for a run from scratch")
        return None
    if t.finetune and t.save is not None:
        if os.path.abspath(t.save) == os.path.abspath(t.load):
            raise ConfigError(f"--finetune with --save {t.save} equal to --load: a relaunch resumes from --save, so "
                              f"this run could never start from --load's weights; save to another directory")
        if os.path.isfile(os.path.join(t.save, "latest")):  # a relaunch: continue this run, in full
            resume = preflight_resume(t.save, config, dims, num_chunks=num_chunks)
            return dataclasses.replace(resume, note=(
                f"--finetune: --save {t.save} already holds a checkpoint ({resume.tag}); resuming from it instead "
                f"of starting over from --load {t.load} (empty --save to start the fine-tuning afresh)"))
    return preflight_resume(t.load, config, dims, finetune=t.finetune, load_optim=not t.no_load_optim,
                            load_rng=not t.no_load_rng, num_chunks=num_chunks)


def restore(resume: Resume | None, model: torch.nn.Module, topology: Topology, tracker: RNGStatesTracker,
            stage_layers: tuple[range, ...], build_engine: Callable[[torch.nn.Module], object]):
    """Build the engine around ``model`` with ``build_engine`` and bring both to where ``resume`` left off (or to
    a fresh start); returns ``(engine, TrainState)``.

    Weights that come without a ZeRO optimizer (universal, weights-only) go into the model before the engine is
    built, so that ZeRO builds its fp32 master copies from them, exactly; a training checkpoint is loaded into
    the built engine. Last, the tied output layer (last stage) takes the first stage's word embedding, in the
    model and in its fp32 master copy.

    Under ``resume.finetune`` a training checkpoint's model files go into the model before the engine is built too,
    and nothing else is restored: a fresh optimizer, LR schedule and TrainState, the RNG streams as seeded."""
    kind = resume.kind if resume is not None else None
    if resume is not None and resume.note and topology.rank == 0:
        print(resume.note, flush=True)
    finetune = resume is not None and resume.finetune
    if kind is ResumeKind.UNIVERSAL:
        load_universal_weights(model, resume.load_dir, resume.tag, pp_rank=topology.pp_rank,
                               stage_layers=stage_layers)
    elif kind is ResumeKind.WEIGHTS or (kind is ResumeKind.TRAINING and finetune):
        load_model_checkpoint(resume.load_dir, model, pp_size=topology.pp_size, pp_rank=topology.pp_rank)
    engine = build_engine(model)
    if finetune:
        state = TrainState()
    elif kind is ResumeKind.UNIVERSAL:
        state = load_universal_training_state(engine, resume.load_dir, resume.tag, pp_rank=topology.pp_rank,
                                              stage_layers=stage_layers, load_optimizer_states=resume.load_optim)
    elif kind is ResumeKind.TRAINING:
        state = load_checkpoint(engine, resume.load_dir, resume.tag, tracker, load_optimizer_states=resume.load_optim,
                                load_rng=resume.load_rng)
    else:
        state = TrainState()
    sync_shared_embedding(engine.module, topology)
    return engine, state
