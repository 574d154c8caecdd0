"""The structure of the files DeepSpeed writes into a training checkpoint, checked before anything indexes them.

A file that unpickles (weights-only, ``safe_load.py``) may still lack a key, hold a string where a number belongs or
name a fragment beyond its partition; DeepSpeed's loader and ``universal.py`` would then end in a KeyError or an
IndexError deep inside, on some ranks. These checks run first (``--load``'s preflight, ``--to-universal``) and
raise :class:`CheckpointError` with one line naming the file and what is wrong in it (keys and types; no values).

* ``mp_rank_XX_model_states.pt`` (``check_model_states``): ``module``, ``param_shapes`` (one mapping per
  parameter group: name -> torch.Size), ``lr_scheduler``, the step counters and the world sizes;
* ``[bf16_]zero_pp_rank_D_mp_rank_XX_optim_states.pt`` (``check_zero_partition``): ``optimizer_state_dict``
  with ZeRO-1/2's keys: per parameter group the flat fp32 partition, its padding, its ``param_slice_mappings``
  (name -> ``fragment_address(numel, start)``, each inside the partition) and Adam's state of the same size.

Which files a tag directory holds (``tag_files``, names only) and whether they are all there: one model file per
model-parallel rank (``check_model_files``) and one ZeRO file per (DP rank, model-parallel rank) of the sizes its
model files record (``check_zero_files``). A missing or surplus file raises :class:`IncompleteCheckpoint`, which says
what part of the state cannot be restored without it (the caller names the flags that load less). Last
(``check_zero_partitions``), each model-parallel rank's ZeRO files must hold, between their DP ranks, as many values
of each parameter as the model built from the flags has: a file of another model would fail inside DeepSpeed's load.
"""

from __future__ import annotations

import enum
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from codegeex_train.config.options import type_name
from codegeex_train.checkpoint.safe_load import CheckpointError, safe_torch_load

MODEL_FILE = re.compile(r"^mp_rank_(\d{2,})_model_states\.pt$")
ZERO_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d{2,})_optim_states\.pt$")
MODEL_INTS = ("global_steps", "global_samples", "skipped_steps", "dp_world_size", "mp_world_size")


def _int(value) -> bool:
    return type(value) is int and value >= 0


def _need(path: Path, where: str, mapping: dict, key: str, ok, what: str):
    if key not in mapping:
        raise CheckpointError(f"{path}: {where} lacks {key!r} (not a DeepSpeed checkpoint file, or a damaged one)")
    value = mapping[key]
    if not ok(value):
        raise CheckpointError(f"{path}: {where}{key!r} is {type_name(value)}, not {what}")
    return value


def check_model_states(path: Path, state: object) -> list[dict[str, torch.Size]]:
    """DeepSpeed's fields of a model file (ours are checked by ``files._load``); returns its ``param_shapes``."""
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: holds {type_name(state)}, not a DeepSpeed model states mapping")
    _need(path, "", state, "module", lambda v: isinstance(v, dict), "a state dict")
    _need(path, "", state, "lr_scheduler", lambda v: isinstance(v, dict), "a mapping")
    for key in MODEL_INTS:
        _need(path, "", state, key, _int, "an integer >= 0")
    shapes = _need(path, "", state, "param_shapes", lambda v: isinstance(v, list), "a list of parameter groups")
    for g, group in enumerate(shapes):
        if not isinstance(group, dict) or not all(isinstance(k, str) and isinstance(s, torch.Size)
                                                  for k, s in group.items()):
            raise CheckpointError(f"{path}: param_shapes[{g}] is not a mapping of parameter names to torch.Size")
    return [dict(group) for group in shapes]


def check_zero_partition(path: Path, state: object, *, adam: bool = False) -> dict:
    """A ZeRO-1/2 optimizer partition file; returns its ``optimizer_state_dict``. Every fragment address must lie
    inside its group's flat partition, and Adam's moments (when present; required with ``adam``) must have the
    partition's size."""
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: holds {type_name(state)}, not a DeepSpeed ZeRO optimizer file")
    osd = _need(path, "", state, "optimizer_state_dict", lambda v: isinstance(v, dict), "a mapping")
    where = "optimizer_state_dict "
    for key in ("loss_scaler", "zero_stage", "partition_count"):
        _need(path, where, osd, key, lambda v: v is not None, "set")
    _need(path, where, osd, "ds_version", lambda v: isinstance(v, str), "a version string")
    _need(path, where, osd, "clip_grad", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number")
    flats = _need(path, where, osd, "single_partition_of_fp32_groups",
                  lambda v: isinstance(v, list) and all(isinstance(t, torch.Tensor) and t.dim() == 1
                                                        and t.is_floating_point() for t in v),
                  "a list of flat (1-D) floating-point tensors")
    groups = len(flats)
    same_length = f"a list of one entry per parameter group ({groups})"
    _need(path, where, osd, "group_paddings",
                     lambda v: isinstance(v, list) and len(v) == groups and all(_int(p) for p in v),
                     f"{same_length}, integers >= 0")
    mappings = _need(path, where, osd, "param_slice_mappings",
                     lambda v: isinstance(v, list) and len(v) == groups and all(isinstance(m, dict) for m in v),
                     f"{same_length}, mappings")
    # A torch optimizer state dict (DeepSpeed's default); with zero_optimization.elastic_checkpoint, a list of one
    # state per group (never with `adam`: --to-universal reads the default layout).
    base = _need(path, where, osd, "base_optimizer_state",
                 lambda v: (isinstance(v, dict) and isinstance(v.get("state"), dict)
                            and isinstance(v.get("param_groups"), list))
                 or (not adam and isinstance(v, list) and len(v) == groups),
                 "a torch optimizer state dict ('state', 'param_groups')")
    states = base["state"] if isinstance(base, dict) else dict(enumerate(base))
    for g, (flat, mapping) in enumerate(zip(flats, mappings)):
        size = flat.numel()
        for name, address in mapping.items():
            numel, start = getattr(address, "numel", None), getattr(address, "start", None)
            if not isinstance(name, str) or not (_int(numel) and _int(start)):
                raise CheckpointError(f"{path}: param_slice_mappings[{g}] holds an entry that is not a parameter name "
                                      f"with a fragment_address(numel, start) of integers >= 0")
            if start + numel > size:
                raise CheckpointError(f"{path}: the fragment of {name[:80]} in parameter group {g} lies at "
                                      f"[{start}, {start + numel}), beyond the group's partition of {size} values")
        moments = states.get(g)
        if moments is None and adam:
            raise CheckpointError(f"{path}: no Adam state for parameter group {g} (not an Adam-trained checkpoint?)")
        if moments is None:
            continue
        if not isinstance(moments, dict):
            raise CheckpointError(f"{path}: base_optimizer_state state[{g}] is {type_name(moments)}, not a mapping")
        for key in ("exp_avg", "exp_avg_sq"):
            if key not in moments:
                if adam:
                    raise CheckpointError(f"{path}: no Adam {key} for parameter group {g} (not an Adam-trained "
                                          f"checkpoint?)")
                continue
            tensor = moments[key]
            if not isinstance(tensor, torch.Tensor) or tensor.numel() != size:
                got = f"{tensor.numel()} values" if isinstance(tensor, torch.Tensor) else type_name(tensor)
                raise CheckpointError(f"{path}: Adam {key} of parameter group {g} has {got}; its partition has "
                                      f"{size}")
        step = moments.get("step")
        if step is not None and not (isinstance(step, (int, float)) and not isinstance(step, bool)
                                     or isinstance(step, torch.Tensor) and step.numel() == 1):
            raise CheckpointError(f"{path}: Adam step of parameter group {g} is {type_name(step)}, not a number")
    return osd


class Part(enum.Enum):
    """What of a training checkpoint cannot be restored when a file is missing or disagrees with the others."""

    MODEL = "model"  # the weights: nothing can be loaded
    TRAINING = "training"  # the state beyond the weights (counters, LR schedule, RNG): the weights alone can
    OPTIMIZER = "optimizer"  # ZeRO's partitions (Adam's moments): all the rest can


class IncompleteCheckpoint(CheckpointError):
    """A file a restore reads is missing, or the files disagree with what the checkpoint records; ``part``: what
    cannot be restored because of it."""

    def __init__(self, message: str, part: Part):
        super().__init__(message)
        self.part = part


@dataclass(frozen=True)
class TagFiles:
    """The DeepSpeed files in a tag directory, by name (nothing read)."""

    tag_dir: Path
    model: dict[int, Path]  # model-parallel rank -> mp_rank_XX_model_states.pt
    zero: dict[tuple[int, int], Path]  # (model-parallel rank, DP rank) -> its ZeRO optimizer file


def tag_files(tag_dir: str | os.PathLike) -> TagFiles:
    tag_dir = Path(tag_dir)
    model, zero = {}, {}
    for name in sorted(os.listdir(tag_dir)):
        if m := MODEL_FILE.match(name):
            model[int(m.group(1))] = tag_dir / name
        elif m := ZERO_FILE.match(name):
            zero[int(m.group(2)), int(m.group(1))] = tag_dir / name
    return TagFiles(tag_dir, model, zero)


def _some(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def check_model_files(files: TagFiles, mp_size: int, recorded: str) -> None:
    """One model file for each of the ``mp_size`` model-parallel ranks (``recorded``: where that number comes from,
    e.g. 'TP 2 x PP 1, as its metadata records'), and none beyond."""
    missing = [f"mp_rank_{r:02d}_model_states.pt" for r in range(mp_size) if r not in files.model]
    if missing:
        raise IncompleteCheckpoint(f"{files.tag_dir} lacks {_some(missing)} ({len(missing)} of its {mp_size} model "
                                   f"files: {recorded})", Part.MODEL)
    extra = [path.name for r, path in files.model.items() if r >= mp_size]
    if extra:
        raise IncompleteCheckpoint(f"{files.tag_dir} holds {_some(extra)} beyond its {mp_size} model files "
                                   f"({recorded}): files of another save are mixed in", Part.MODEL)


def check_zero_files(files: TagFiles, mp_size: int, dp_size: int) -> None:
    """One ZeRO optimizer file per (DP rank, model-parallel rank) of the sizes the model files record, none beyond."""
    prefix = "bf16_" if any(path.name.startswith("bf16_") for path in files.zero.values()) else ""
    missing = [f"{prefix}zero_pp_rank_{d}_mp_rank_{r:02d}_optim_states.pt" for r in range(mp_size)
               for d in range(dp_size) if (r, d) not in files.zero]
    sizes = f"DP {dp_size} x {mp_size} model-parallel rank{'s' if mp_size > 1 else ''}, as its model files record"
    if missing:
        raise IncompleteCheckpoint(f"{files.tag_dir} lacks the ZeRO optimizer file{'s' if len(missing) > 1 else ''} "
                                   f"{_some(missing)} ({len(missing)} of {mp_size * dp_size}: {sizes})", Part.OPTIMIZER)
    extra = [path.name for (r, d), path in files.zero.items() if r >= mp_size or d >= dp_size]
    if extra:
        raise IncompleteCheckpoint(f"{files.tag_dir} holds {_some(extra)} beyond its {mp_size * dp_size} ZeRO "
                                   f"optimizer files ({sizes}): files of another save are mixed in", Part.OPTIMIZER)


def _check_fragments(files: TagFiles, mp_rank: int, values: dict[str, int], expected: dict[str, tuple]) -> None:
    """The DP ranks' fragments of each parameter of ``mp_rank`` add up to the parameter the model has."""
    where = f"{files.tag_dir}: the ZeRO optimizer files of model-parallel rank {mp_rank}"
    for name, shape in expected.items():
        if values.get(name, 0) != math.prod(shape):
            raise CheckpointError(f"{where} hold {values.get(name, 0)} values of parameter {name} across the DP "
                                  f"ranks; the model built from the flags has {math.prod(shape)} (shape {shape})")
    extra = next((name for name in values if name not in expected), None)
    if extra is not None:
        raise CheckpointError(f"{where} hold parameter {extra[:100]}, which the model built from the flags lacks")


def check_zero_partitions(files: TagFiles, expected: dict[int, dict[str, tuple]]) -> None:
    """Before DeepSpeed's ``load_checkpoint``: every ZeRO partition file has the structure DeepSpeed indexes
    (memory-mapped reads: pickles only), and each model-parallel rank's files hold, between their DP ranks, exactly
    the values of its parameters in ``expected`` (model-parallel rank -> parameter name -> shape)."""
    values: dict[int, dict[str, int]] = {mp_rank: {} for mp_rank in expected}
    for (mp_rank, _), path in sorted(files.zero.items()):
        osd = check_zero_partition(path, safe_torch_load(path, mmap=True))
        counts = values.setdefault(mp_rank, {})
        for mapping in osd["param_slice_mappings"]:
            for name, address in mapping.items():
                counts[name] = counts.get(name, 0) + address.numel
    for mp_rank, shapes in expected.items():
        _check_fragments(files, mp_rank, values[mp_rank], shapes)
