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

Which checkpoint (``preflight_load``): a ``--save`` that holds a run is that run's (``checkpoint/run_dir.py``): it is
resumed in full without ``--load`` (a relaunch), and another run's ``--load`` there is refused unless --start-over
(the old run is moved aside first). A resume keeps the LR schedule the checkpoint records, or is refused, unless
Megatron's --override-opt_param-scheduler or --use-checkpoint-opt_param-scheduler decides
(``config/lr_schedule.py``).

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
from codegeex_train.checkpoint.run_dir import holds_run, recorded_run_id
from codegeex_train.config.arguments import ConfigError, TrainConfig
from codegeex_train.config.lr_schedule import (
    OVERRIDE_FLAG,
    USE_CHECKPOINT_FLAG,
    LRScheduleShape,
    SchedulePolicy,
    extend_hint,
    schedule_differences,
)
from codegeex_train.config.model_config import ModelConfig
from codegeex_train.layout.plan import ParallelPlan
from codegeex_train.distributed.topology import Topology
from codegeex_train.layout.dims import ParallelDims, model_parallel_rank
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
    schedule: LRScheduleShape | None = None  # the LR schedule it records (training and universal checkpoints)


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
    flags += _architecture_flags(stored, config)
    if stored.padded_vocab_size != config.padded_vocab_size and 0 < config.vocab_size <= stored.padded_vocab_size:
        # An imported family model has more rows than its tokenizer has ids (Qwen2.5-Coder: 152,064 for 151,665)
        flags.append(f"--make-vocab-size-divisible-by {stored.padded_vocab_size} (its {stored.padded_vocab_size}-row "
                     f"word table holds this tokenizer's {config.vocab_size} ids)")
    elif stored.padded_vocab_size != config.padded_vocab_size:
        flags.append(f"the tokenizer flags it was trained with (a vocabulary padded to {stored.padded_vocab_size}, "
                     f"see --make-vocab-size-divisible-by)")
    return ", ".join(flags)


def _architecture_flags(stored: ModelConfig, config: ModelConfig) -> list[str]:
    """The architecture switches (with the checkpoint's settings) on which this run differs from it."""
    def on_off(flag: str, on: bool) -> str:
        return flag if on else f"no {flag}"

    flags = []
    if stored.normalization != config.normalization:
        flags.append(f"--normalization {stored.normalization}")
    if stored.swiglu != config.swiglu:
        flags.append(on_off("--swiglu", stored.swiglu))
    if stored.kv_groups != config.kv_groups:
        grouped = stored.kv_groups != stored.num_attention_heads
        flags.append(f"--group-query-attention --num-query-groups {stored.kv_groups}" if grouped
                     else "no --group-query-attention")
    if (stored.linear_bias, stored.qkv_bias) != (config.linear_bias, config.qkv_bias):
        flags.append("no --disable-bias-linear" if stored.linear_bias else
                     "--disable-bias-linear" + (" --add-qkv-bias" if stored.qkv_bias else " (no --add-qkv-bias)"))
    if stored.tied_output != config.tied_output:
        flags.append(on_off("--untie-embeddings-and-output-weights", not stored.tied_output))
    return flags


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
    return [sorted(_layers(states[model_parallel_rank(0, pp_rank, tp_size)]["module"])) for pp_rank in range(pp_size)]


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
            return Resume(load_dir, tag, ResumeKind.UNIVERSAL, meta, **flags,
                          schedule=LRScheduleShape.from_state(meta["lr_scheduler"]))
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
    ours = {"TP": dims.tp_size, "PP": dims.pp_size, "DP": dims.data_shards,
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
    return Resume(load_dir, tag, kind, meta, **flags, schedule=LRScheduleShape.from_state(states[0].get("lr_scheduler")))


def _same_dir(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def _start_in_save(t: TrainConfig) -> str:
    """Why a run that holds --save's run may not start here: the one line of the refusal, with its fixes."""
    return (f"--save {t.save} holds a run ('latest' names {_latest_or_damaged(t.save)}), and --load {t.load} is "
            f"another run's checkpoint: a start here would overwrite that run. To continue it, drop --load (or "
            f"--load {t.save}); to start a new run in it from --load, add --start-over (its checkpoints move to "
            f"{os.path.join(t.save, 'previous-runs')}/, nothing is deleted); or give this run another --save")


def _latest_or_damaged(directory: str) -> str:
    try:
        return read_latest(directory)
    except CheckpointError:
        return "no readable tag"


def _check_schedule(resume: Resume, ours: LRScheduleShape, policy: SchedulePolicy) -> Resume:
    """Megatron's rule on resume (config/lr_schedule.py): the checkpoint's LR schedule equals the flags', or one of
    the two flags decides; the run's own values under --use-checkpoint-opt_param-scheduler are the checkpoint's
    (``resume.schedule``, which ``pretrain.prepare`` puts into the run's optimizer config)."""
    if resume.finetune or resume.kind is ResumeKind.WEIGHTS or resume.schedule is None:
        return resume
    differences = schedule_differences(resume.schedule, ours)
    if not differences:
        return resume
    where = f"{resume.load_dir} ({resume.tag})"
    if policy is SchedulePolicy.CHECK:
        hint = extend_hint(resume.schedule, ours)
        raise ConfigError(f"resuming {where}: its LR schedule differs from these flags': {'; '.join(differences)}. "
                          f"{hint + '; or d' if hint else 'D'}ecide which applies: {OVERRIDE_FLAG} (these flags' "
                          f"schedule, from the checkpoint's position) or {USE_CHECKPOINT_FLAG} (the checkpoint's)")
    winner = "these flags'" if policy is SchedulePolicy.OVERRIDE else "the checkpoint's"
    note = f"the LR schedule is {winner} ({'; '.join(differences)})"
    return dataclasses.replace(resume, note=f"{resume.note}; {note}" if resume.note else note)


def preflight_load(train: TrainConfig, config: ModelConfig, plan: ParallelPlan,
                   schedule: LRScheduleShape | None = None,
                   policy: SchedulePolicy = SchedulePolicy.CHECK) -> Resume | None:
    """What this run starts from, checked before any process group: None (a fresh start), or a checkpoint with what
    to restore of it. A ``--save`` that holds a run (checkpoint/run_dir.py) is resumed in full when no ``--load`` is
    given, when ``--load`` names a checkpoint of the same run (a relaunch of a run started from it), and under
    --finetune (a relaunch); another ``--load`` there is refused unless --start-over (then ``pretrain.main`` moves
    the old run aside before anything is written). Otherwise ``--load`` with --finetune, --no-load-optim,
    --no-load-rng. Nonsense combinations raise ConfigError naming the flags. Checked against this run's ``config``
    (the vocabulary resolved), ``plan`` (sizes, chunks, each stage's layers) and its LR ``schedule`` (``policy``:
    what a difference does)."""
    t = train
    dims, num_chunks, stage_layers = plan.dims, plan.num_chunks, plan.stage_layers or None
    if t.start_over and t.save is None:
        raise ConfigError("--start-over starts a new run in the --save directory that holds one: give --save DIR")
    if t.start_over and t.load is not None and _same_dir(t.load, t.save):
        raise ConfigError(f"--start-over with --load {t.load} equal to --save: it would move the checkpoint to load "
                          f"into {os.path.join(t.save, 'previous-runs')}/ first; --load the run's other copy, or drop "
                          f"--start-over to continue it")
    if t.load is None and (t.finetune or t.no_load_optim or t.no_load_rng):
        given = " ".join(flag for flag, on in (("--finetune", t.finetune), ("--no-load-optim", t.no_load_optim),
                                               ("--no-load-rng", t.no_load_rng)) if on)
        raise ConfigError(f"{given} without --load: they say what to take from the checkpoint --load names; pass "
                          f"--load CHECKPOINT_DIR (for --finetune: a training, universal or weights-only one), or "
                          f"drop {given} for a run from scratch")
    if t.finetune and t.save is not None and _same_dir(t.save, t.load):
        raise ConfigError(f"--finetune with --save {t.save} equal to --load: a relaunch resumes from --save, so "
                          f"this run could never start from --load's weights; save to another directory")
    resume = None
    if t.save is not None and not t.start_over and holds_run(t.save) and (t.load is None
                                                                           or not _same_dir(t.load, t.save)):
        if t.load is None:
            why = "resuming it (a relaunch continues its run)"
        elif t.finetune:
            why = f"resuming it instead of starting over from --load {t.load} (this run saved before it stopped)"
        elif (run := recorded_run_id(t.save)) is not None and run == recorded_run_id(t.load):
            why = f"resuming it instead of --load {t.load}, which that run started from (a relaunch)"
        else:
            raise ConfigError(_start_in_save(t))
        resume = preflight_resume(t.save, config, dims, num_chunks=num_chunks, stage_layers=stage_layers)
        resume = dataclasses.replace(resume, note=(
            f"--save {t.save} holds a run ({resume.tag}): {why}; --start-over starts a new run there instead"))
    elif t.load is not None:
        resume = preflight_resume(t.load, config, dims, finetune=t.finetune, load_optim=not t.no_load_optim,
                                  load_rng=not t.no_load_rng, num_chunks=num_chunks, stage_layers=stage_layers)
    if resume is None or schedule is None:
        return resume
    return _check_schedule(resume, schedule, policy)


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
                                load_rng=resume.load_rng, topology=topology)
    else:
        state = TrainState()
    sync_shared_embedding(engine.module, topology)
    return engine, state
