"""Where a run starts: ``--load`` checked before any process group (``preflight_resume``), then restored in one
call (``restore``).

A ``--load`` directory holds one of three kinds of checkpoint (``ResumeKind``):

* TRAINING: saved by a run at this TP / PP / DP layout: model, ZeRO optimizer partitions, LR schedule,
  counters and RNG streams, all restored by DeepSpeed's ``load_checkpoint``. Whatever a training run wrote is one,
  even with files missing: a training state recorded, ZeRO files, or DeepSpeed's fields in the model file;
* UNIVERSAL: layout-free (``checkpoint/universal.py``): weights and Adam moments split for this layout;
* WEIGHTS: model files alone (converted from Hugging Face or CodeGeeX, or re-sharded): the training state
  starts afresh.

A training checkpoint is restored in full or refused: a missing model or ZeRO file, a training state missing or
disagreeing with the files (its iteration and the tag, the world sizes DeepSpeed recorded and the files present) is
one error naming what is missing and the flags below that deliberately load less. Every tensor the run will load,
of every kind, has the shape of the model built from the flags (computed from the config, ``files.py``), or the
error names the first parameter and both shapes.

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
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable

import torch

from codegeex_train.checkpoint.deepspeed_files import (
    IncompleteCheckpoint,
    Part,
    TagFiles,
    check_model_files,
    check_zero_files,
    check_zero_partitions,
    tag_files,
)
from codegeex_train.checkpoint.files import (
    META_KEY,
    CheckpointError,
    describe_shape_difference,
    first_tensor_difference,
    load_model_checkpoint,
    model_parameter_shapes,
    rank_parameter_shapes,
    read_checkpoint_meta,
    read_latest,
    read_model_file,
    saved_num_chunks,
    state_dict_shapes,
)
from codegeex_train.checkpoint.safe_load import verify_checkpoint_dir
from codegeex_train.checkpoint.train_state import TrainState
from codegeex_train.checkpoint.deepspeed_checkpoint import check_training_state, load_checkpoint
from codegeex_train.checkpoint.universal import (
    check_universal_tensors,
    is_universal,
    load_universal_training_state,
    load_universal_weights,
    read_universal_meta,
)
from codegeex_train.config.arguments import ConfigError, TrainConfig
from codegeex_train.config.model_config import ModelConfig
from codegeex_train.config.plan import ParallelPlan
from codegeex_train.distributed.topology import ParallelDims, Topology
from codegeex_train.pipeline import sync_shared_embedding
from codegeex_train.tensor_parallel import RNGStatesTracker

logger = logging.getLogger(__name__)


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
# What to do when a part of a training checkpoint is missing or disagrees with the rest: the flags that load less.
_LOAD_LESS = {
    Part.MODEL: "no flag loads a checkpoint without its model weights: restore the files, or write an earlier "
                "complete tag into {d}/latest",
    Part.TRAINING: "to start a fresh run from its weights (iteration, LR schedule, optimizer and RNG afresh), pass "
                   "--finetune",
    Part.OPTIMIZER: "pass --no-load-optim to restore all but the optimizer state (Adam's moments start afresh; the "
                    "iteration, LR schedule and RNG streams continue), or --finetune for the weights only",
}
# The flag that sets each field of SHAPE_FIELDS (the padded vocabulary: the tokenizer's, rounded up).
_SHAPE_FLAGS = {"num_layers": "--num-layers", "hidden_size": "--hidden-size", "num_attention_heads":
                "--num-attention-heads", "ffn_hidden_size": "--ffn-hidden-size", "max_position_embeddings":
                "--max-position-embeddings", "position_embedding_type": "--position-embedding-type"}
_LAYER = re.compile(r"layers\.(\d+)\.")


def _model_flags(stored: ModelConfig, config: ModelConfig) -> str:
    """The flags (with the checkpoint's values) that give this run the checkpoint's model shape."""
    derived_ffn = stored.ffn_hidden_size == 4 * stored.hidden_size and config.ffn_hidden_size == 4 * config.hidden_size
    flags = [f"{flag} {getattr(stored, k)}" for k, flag in _SHAPE_FLAGS.items()
             if getattr(stored, k) != getattr(config, k) and not (k == "ffn_hidden_size" and derived_ffn)
             and not (k == "max_position_embeddings" and stored.rope)]  # RoPE: no table to match
    if stored.top_query_layer != config.top_query_layer:
        flags.append("--top-query-layer" if stored.top_query_layer else "--no-top-query-layer")
    if stored.padded_vocab_size != config.padded_vocab_size:
        flags.append(f"the tokenizer flags it was trained with (a vocabulary padded to {stored.padded_vocab_size}, "
                     f"see --make-vocab-size-divisible-by)")
    return ", ".join(flags)


def _check_same_model(load_dir: str, tag: str, meta: dict, config: ModelConfig) -> None:
    stored = ModelConfig(**meta["model_config"])
    diff = describe_shape_difference(stored, config)
    if diff:
        raise ConfigError(f"--load {load_dir} ({tag}) was saved from a different model ({diff}): use the same "
                          f"model flags as the checkpoint ({_model_flags(stored, config)})")


def _layers(names) -> set[int]:
    return {int(m.group(1)) for name in names if (m := _LAYER.match(name))}


def _check_tensors(where: str, shapes: dict[str, tuple | None], expected: dict[str, tuple], pp_size: int = 1) -> None:
    """The tensors of a file (``shapes``) against the shapes the model built from the flags has. The recorded model
    was checked before (``_check_same_model``): a difference here is in the tensors themselves."""
    diff = first_tensor_difference(shapes, expected)
    if diff is None:
        return
    if pp_size > 1 and _layers(shapes) != _layers(expected):
        hint = ("it was saved with another split of the layers over the pipeline stages: pass the same "
                "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers as the run that saved it, "
                "or re-shard it with tools/convert_checkpoint.py")
    else:
        hint = ("its metadata records the model of these flags, so the file holds other tensors than it says (damaged, "
                "edited, or converted from another model): convert the source again, or load an intact copy")
    raise CheckpointError(f"{where}: {diff}; {hint}")


def _universal_shapes(load_dir: str, tag: str) -> dict[str, tuple[int, ...]]:
    """Name -> shape of a universal checkpoint's fp32 tensors (its safetensors header; ``check_universal_tensors``
    read it before)."""
    from safetensors import safe_open

    with safe_open(os.path.join(load_dir, tag, "fp32.safetensors"), framework="pt") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}


def _kind(meta: dict, files: TagFiles, state: dict) -> ResumeKind:
    """TRAINING for whatever a training run (DeepSpeed) saved, even with parts of it missing (the checks after say
    which): a training state recorded, ZeRO files, or DeepSpeed's fields in the model file; WEIGHTS for model files
    alone (converted or re-sharded weights)."""
    deepspeed = bool(files.zero) or any(key in state for key in ("param_shapes", "lr_scheduler", "global_steps"))
    return ResumeKind.TRAINING if "train_state" in meta or deepspeed else ResumeKind.WEIGHTS


def _check_same_save(files: TagFiles, states: dict[int, dict]) -> None:
    """Every model file records the save rank 0's records (a file copied in from another save would not)."""
    first = states[0][META_KEY]
    for mp_rank, state in states.items():
        for key in ("iteration", "tp_size", "pp_size", "num_chunks", "model_config"):
            theirs, ours = state[META_KEY].get(key), first.get(key)
            if theirs != ours:
                shown = f"{key} {theirs} (mp_rank_00: {ours})" if key != "model_config" else "another model_config"
                raise IncompleteCheckpoint(f"{files.model[mp_rank]} records {shown}: files of different saves are "
                                           f"mixed in", Part.MODEL)


def _run_stage_layers(config: ModelConfig, pp_size: int, stage_layers, states: dict[int, dict], tp_size: int):
    """Each stage's layers as this run splits them; unknown (not given) at PP > 1: as the files hold them."""
    if stage_layers is not None:
        return [list(layers) for layers in stage_layers]
    if pp_size == 1:
        return [range(config.num_layers)]
    return [sorted(_layers(states[pp_rank * tp_size]["module"])) for pp_rank in range(pp_size)]


def preflight_resume(load_dir: str, config: ModelConfig, dims: ParallelDims, *, finetune: bool = False,
                     load_optim: bool = True, load_rng: bool = True, num_chunks: int = 1,
                     stage_layers: Sequence[Sequence[int]] | None = None) -> Resume:
    """Check ``--load`` before any process group: a complete checkpoint of this model shape, saved at this
    run's TP / PP / DP sizes, or a universal one (any layout), or model weights at this TP / PP size; every tensor
    of the shape the model built from the flags has (``stage_layers``: this run's layers of each pipeline stage;
    None: as the checkpoint splits them). The DP size matters only when the ZeRO optimizer partitions are loaded (not
    under ``finetune`` or without ``load_optim``).

    A training checkpoint is restored in full unless the flags say otherwise: a missing file or a training state
    that disagrees with the files is refused, naming the flags that deliberately load less (``_LOAD_LESS``)."""
    flags = {"finetune": finetune, "load_optim": load_optim, "load_rng": load_rng}
    try:
        tag = read_latest(load_dir)
        verify_checkpoint_dir(load_dir, tag)  # weights-only, before DeepSpeed unpickles any of its files
        if is_universal(load_dir, tag):
            meta = read_universal_meta(load_dir, tag)
            check_universal_tensors(load_dir, tag)
            _check_same_model(load_dir, tag, meta, config)
            _check_tensors(f"{load_dir}/{tag}/fp32.safetensors", _universal_shapes(load_dir, tag),
                           model_parameter_shapes(config))
            return Resume(load_dir, tag, ResumeKind.UNIVERSAL, meta, **flags)
        tag, meta = read_checkpoint_meta(load_dir)
        _check_same_model(load_dir, tag, meta, config)
        files = tag_files(os.path.join(load_dir, tag))
        tp, pp = meta["tp_size"], meta["pp_size"]
        check_model_files(files, tp * pp, f"TP {tp} x PP {pp}, as its metadata records")
        states = {mp_rank: read_model_file(path) for mp_rank, path in files.model.items()}
        _check_same_save(files, states)
        kind = _kind(meta, files, states[0])
        if kind is ResumeKind.WEIGHTS and not finetune and not (load_optim and load_rng):
            given = " ".join(flag for flag, off in (("--no-load-optim", not load_optim),
                                                    ("--no-load-rng", not load_rng)) if off)
            raise ConfigError(f"{given}: --load {load_dir} ({tag}) holds model weights only, no training state to "
                              f"continue (iteration, LR schedule, RNG streams): drop {given}; a run from model "
                              f"weights starts its training state afresh (as --finetune does)")
        full = kind is ResumeKind.TRAINING and not finetune  # what DeepSpeed will index, checked before it does
        saved_dp = check_training_state(tag, files, states) if full else None
        if full and load_optim:
            check_zero_files(files, tp * pp, saved_dp)
    except IncompleteCheckpoint as e:
        raise ConfigError(f"--load {load_dir}: {e}; {_LOAD_LESS[e.part].format(d=load_dir)}") from None
    except CheckpointError as e:
        raise ConfigError(f"--load {load_dir}: {e}") from None
    # v: each rank's file holds its chunks' layers, which v changes
    saved = {"TP": tp, "PP": pp, "virtual pipeline chunks per rank": saved_num_chunks(meta)}
    if full and load_optim:
        saved["DP"] = saved_dp
    # ZeRO partitions over DeepSpeed's data-parallel group, DP x CP
    ours = {"TP": dims.tp_size, "PP": dims.pp_size, "DP": dims.dp_cp_size,
            "virtual pipeline chunks per rank": num_chunks}
    diff = [k for k in saved if saved[k] != ours[k]]
    if diff:
        layout = ", ".join(f"{k} {saved[k]} (this run {ours[k]})" for k in diff)
        hint = _TO_UNIVERSAL.format(d=load_dir) if "DP" in saved else (
            "tools/convert_checkpoint.py re-shards these model weights to another TP and PP size (and "
            "--num-layers-per-virtual-pipeline-stage)")
        raise ConfigError(f"--load {load_dir} ({tag}) was saved at another parallel layout: {layout}; {hint}")
    layers = _run_stage_layers(config, pp, stage_layers, states, tp)
    expected = {mp_rank: rank_parameter_shapes(config, tp, layers, mp_rank // tp) for mp_rank in range(tp * pp)}
    try:
        for mp_rank, state in states.items():
            _check_tensors(str(files.model[mp_rank]), state_dict_shapes(state["module"]), expected[mp_rank], pp)
        if full and load_optim:
            check_zero_partitions(files, expected)
    except CheckpointError as e:
        raise ConfigError(f"--load {load_dir}: {e}") from None
    return Resume(load_dir, tag, kind, meta, **flags)


def preflight_load(train: TrainConfig, config: ModelConfig, plan: ParallelPlan) -> Resume | None:
    """What this run starts from, checked before any process group: None (a fresh start), or ``--load`` with
    what to restore of it (--finetune, --no-load-optim, --no-load-rng); under --finetune, --save instead when it
    already holds a checkpoint (a relaunch). Nonsense combinations raise ConfigError naming the flags. Checked
    against this run's ``config`` (the vocabulary resolved) and ``plan`` (sizes, chunks, each stage's layers)."""
    t = train
    dims, num_chunks, stage_layers = plan.dims, plan.num_chunks, plan.stage_layers or None
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
            resume = preflight_resume(t.save, config, dims, num_chunks=num_chunks, stage_layers=stage_layers)
            return dataclasses.replace(resume, note=(
                f"--finetune: --save {t.save} already holds a checkpoint ({resume.tag}); resuming from it instead "
                f"of starting over from --load {t.load} (empty --save to start the fine-tuning afresh)"))
    return preflight_resume(t.load, config, dims, finetune=t.finetune, load_optim=not t.no_load_optim,
                            load_rng=not t.no_load_rng, num_chunks=num_chunks, stage_layers=stage_layers)


def restore(resume: Resume | None, model: torch.nn.Module, topology: Topology, tracker: RNGStatesTracker,
            plan: ParallelPlan, build_engine: Callable[[torch.nn.Module], object]):
    """Build the engine around ``model`` with ``build_engine`` and bring both to where ``resume`` left off (or to
    a fresh start); returns ``(engine, TrainState)``.

    Weights that come without a ZeRO optimizer (universal, weights-only) go into the model before the engine is
    built, so that ZeRO builds its fp32 master copies from them, exactly; a training checkpoint is loaded into
    the built engine. Last, the tied output layer (last stage) takes the first stage's word embedding, in the
    model and in its fp32 master copy.

    Under ``resume.finetune`` a training checkpoint's model files go into the model before the engine is built too,
    and nothing else is restored: a fresh optimizer, LR schedule and TrainState, the RNG streams as seeded."""
    kind, stage_layers = resume.kind if resume is not None else None, plan.stage_layers
    if resume is not None and resume.note:
        logger.info(resume.note)
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
                                load_rng=resume.load_rng, cp_rank=topology.cp_rank, cp_size=topology.cp_size)
    else:
        state = TrainState()
    sync_shared_embedding(engine.module, topology)
    return engine, state
