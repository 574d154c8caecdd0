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
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from codegeex_train.checkpoint.files import type_name
from codegeex_train.checkpoint.safe_load import CheckpointError, safe_torch_load

ZERO_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d{2})_optim_states\.pt$")
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


def check_training_files(load_dir, tag: str, mp_size: int, *, optimizer: bool) -> None:
    """Before DeepSpeed's ``load_checkpoint``: every model-parallel rank's model file and (``optimizer``) every ZeRO
    partition file of ``load_dir/tag`` has the structure DeepSpeed indexes (memory-mapped reads: pickles only)."""
    tag_dir = Path(load_dir) / tag
    for mp_rank in range(mp_size):
        path = tag_dir / f"mp_rank_{mp_rank:02d}_model_states.pt"
        check_model_states(path, safe_torch_load(path, mmap=True))
    if optimizer:
        for path in sorted(p for p in tag_dir.iterdir() if ZERO_FILE.match(p.name)):
            check_zero_partition(path, safe_torch_load(path, mmap=True))
