"""A layout-free ("universal") training checkpoint: resume at any (TP, PP, DP) the model allows.

A training checkpoint is cut three ways: the model by TP rank and pipeline stage (``mp_rank_XX`` files), and
DeepSpeed ZeRO-2's fp32 master weights and Adam moments by DP rank as well (``zero_pp_rank_D_mp_rank_XX``
files, each a slice of one flat buffer per parameter group). ``to_universal`` undoes all three cuts:

1. per model-parallel rank, concatenate the DP ranks' fragments of each parameter in DP order (the optimizer
   file's ``param_slice_mappings`` say where each named parameter's fragment lies in that rank's slice), and
   reshape to the parameter's shape (``param_shapes`` of the model file);
2. per stage, merge the TP shards with the same name table as the model weights (``checkpoint/sharding.py``: which
   dimension, fused Q/K/V and K/V blocks as strided blocks, the padded vocabulary rows);
3. join the stages; the last stage's tied copy of the word table is dropped after checking that it equals the
   first stage's (the shared-embedding gradient sum keeps their weights and moments identical).

The result, in ``<dir>/<tag>/``: ``fp32.safetensors``, ``exp_avg.safetensors``, ``exp_avg_sq.safetensors``
(full tensors under the TP = PP = 1 model's names) and ``universal.json`` (model config, Adam's step count,
the LR schedule, iteration, consumed samples, the source layout, the tokenizer settings when the source records
them). Resuming from it (``--load`` detects it): weights are split for this run's layout and loaded before
``deepspeed.initialize`` (so ZeRO builds its fp32 masters from them, exactly), then each parameter's moments are
written into its ZeRO partition with ``safe_set_full_optimizer_state``, Adam's step count into every parameter
group, and the LR schedule and counters restored. Random-number streams start afresh from ``--seed``: dropout masks
depend on the layout.

Hyper-parameters (betas, weight decay, clipping) come from the resuming run's flags, as do batch sizes; the
global batch size must stay the same for the data order and LR schedule to continue exactly.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections import defaultdict
from pathlib import Path

import torch

from codegeex_train.checkpoint.files import CheckpointError, read_checkpoint_meta, read_latest, write_latest
from codegeex_train.checkpoint.safe_load import safe_torch_load
from codegeex_train.checkpoint.sharding import merge_state_dicts, split_model_parallel
from codegeex_train.checkpoint.train_state import TrainState
from codegeex_train.config.model import ModelConfig

UNIVERSAL_META = "universal.json"
STATES = ("fp32", "exp_avg", "exp_avg_sq")
FORMAT = "codegeex_train-universal/1"


def is_universal(load_dir: str | os.PathLike, tag: str) -> bool:
    return (Path(load_dir) / tag / UNIVERSAL_META).is_file()


def _load(path: Path) -> dict:
    return safe_torch_load(path)  # weights-only: DeepSpeed's few plain types allow-listed, nothing run


def _optim_files(tag_dir: Path, mp_rank: int) -> list[Path]:
    pattern = re.compile(rf"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_{mp_rank:02d}_optim_states\.pt$")
    found = sorted(((int(m.group(1)), p) for p in tag_dir.iterdir() if (m := pattern.match(p.name))))
    if not found or [d for d, _ in found] != list(range(len(found))):
        raise CheckpointError(f"{tag_dir}: ZeRO optimizer files of model-parallel rank {mp_rank} are missing or "
                              f"incomplete (DP ranks found: {[d for d, _ in found]})")
    return [p for _, p in found]


def _mp_rank_states(tag_dir: Path, mp_rank: int) -> tuple[dict[str, dict[str, torch.Tensor]], int]:
    """{state: {name: tensor}} of one model-parallel rank, its DP slices joined; and Adam's step count."""
    shapes = [dict(group) for group in _load(tag_dir / f"mp_rank_{mp_rank:02d}_model_states.pt")["param_shapes"]]
    fragments: dict[str, dict[str, list[torch.Tensor]]] = {s: defaultdict(list) for s in STATES}
    steps = set()
    for path in _optim_files(tag_dir, mp_rank):  # DP order: each rank holds the next slice of every group
        osd = _load(path)["optimizer_state_dict"]
        for g, mapping in enumerate(osd["param_slice_mappings"]):
            flat = {"fp32": osd["single_partition_of_fp32_groups"][g]}
            adam = osd["base_optimizer_state"]["state"].get(g, {})
            if "step" in adam:
                steps.add(int(adam["step"]))
            for state in STATES[1:]:
                flat[state] = adam.get(state)
            for name, address in mapping.items():
                for state, tensor in flat.items():
                    if tensor is None:
                        raise CheckpointError(f"{path}: no Adam {state} (not an Adam-trained checkpoint?)")
                    fragments[state][name].append(tensor.narrow(0, address.start, address.numel))
    if len(steps) != 1:
        raise CheckpointError(f"{tag_dir}: Adam step counts {sorted(steps)} differ between parameter groups")
    out: dict[str, dict[str, torch.Tensor]] = {s: {} for s in STATES}
    for group in shapes:
        for name, shape in group.items():
            for state in STATES:
                flat = torch.cat(fragments[state][name]) if fragments[state][name] else torch.empty(0)
                if flat.numel() != shape.numel():
                    raise CheckpointError(f"{tag_dir}: {name} has {flat.numel()} {state} values across the DP "
                                          f"ranks, expected {shape.numel()} for shape {tuple(shape)}")
                out[state][name] = flat.view(shape).clone()
    return out, steps.pop()


def to_universal(load_dir: str | os.PathLike, save_dir: str | os.PathLike) -> str:
    """Convert ``load_dir``'s latest training checkpoint (any TP, PP, DP) to a universal one in ``save_dir``;
    returns the tag."""
    from safetensors.torch import save_file

    if is_universal(load_dir, read_latest(load_dir)):
        raise CheckpointError(f"{load_dir} is already a universal checkpoint: --load it at any layout as it is")
    tag, meta = read_checkpoint_meta(load_dir)
    tag_dir = Path(load_dir) / tag
    if "train_state" not in meta:
        raise CheckpointError(f"{tag_dir} holds model weights only (no optimizer state to convert): load it "
                              f"with --load as it is")
    config = ModelConfig(**meta["model_config"])
    tp, pp = meta["tp_size"], meta["pp_size"]
    full: dict[str, dict[str, torch.Tensor]] = {s: {} for s in STATES}
    steps = set()
    for pp_rank in range(pp):
        shards = []
        for tp_rank in range(tp):
            states, step = _mp_rank_states(tag_dir, pp_rank * tp + tp_rank)
            shards.append(states)
            steps.add(step)
        for state in STATES:
            merged = merge_state_dicts([s[state] for s in shards], config)
            for name, tensor in merged.items():
                if name in full[state]:  # the tied word table: the last stage's copy must equal the first's
                    if not torch.equal(full[state][name], tensor):
                        raise CheckpointError(f"{tag_dir}: the last stage's copy of {name} ({state}) differs from "
                                              f"the first stage's: the tied embedding was out of sync")
                    continue
                full[state][name] = tensor
    if len(steps) != 1:
        raise CheckpointError(f"{tag_dir}: Adam step counts {sorted(steps)} differ between ranks")
    model_file = _load(tag_dir / "mp_rank_00_model_states.pt")
    dp = len(_optim_files(tag_dir, 0))
    train_state = {k: v for k, v in meta["train_state"].items() if k != "rng"}  # RNG streams are per layout
    universal = {
        "format": FORMAT, "model_config": meta["model_config"], "iteration": meta["iteration"],
        "train_state": train_state, "adam_step": steps.pop(), "lr_scheduler": model_file["lr_scheduler"],
        "global_steps": model_file["global_steps"], "global_samples": model_file["global_samples"],
        "skipped_steps": model_file["skipped_steps"], "source_layout": {"tp": tp, "pp": pp, "dp": dp},
    }
    if "tokenizer" in meta:
        universal["tokenizer"] = meta["tokenizer"]
    out = Path(save_dir) / tag
    out.mkdir(parents=True, exist_ok=True)
    for state in STATES:
        save_file({k: v.contiguous() for k, v in full[state].items()}, str(out / f"{state}.safetensors"))
    (out / UNIVERSAL_META).write_text(json.dumps(universal, indent=1) + "\n")  # last: marks the tag complete
    write_latest(save_dir, tag)
    return tag


def read_universal_meta(load_dir: str | os.PathLike, tag: str) -> dict:
    meta = json.loads((Path(load_dir) / tag / UNIVERSAL_META).read_text())
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{Path(load_dir) / tag}: unknown universal checkpoint format {meta.get('format')!r}")
    return meta


def _stage_shard(load_dir, tag, state: str, config: ModelConfig, tp_size: int, tp_rank: int, pp_rank: int,
                 stage_layers: list[range]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    full = load_file(str(Path(load_dir) / tag / f"{state}.safetensors"))
    return split_model_parallel(full, config, tp_size, stage_layers)[pp_rank * tp_size + tp_rank]


def load_universal_weights(model: torch.nn.Module, load_dir, tag: str, *, pp_rank: int,
                           stage_layers: list[range]) -> None:
    """Before ``deepspeed.initialize``: this rank's slice of the fp32 weights into ``model`` (strict)."""
    model.load_state_dict(_stage_shard(load_dir, tag, "fp32", model.config, model.tp_size, model.tp_rank, pp_rank,
                                       stage_layers))


def _create_adam_state(zero, step: int) -> None:
    """Give ZeRO-2's wrapped AdamW the state it would hold after ``step`` steps (moments zero until set), and
    link each parameter's fragment to it. DeepSpeed (0.19.8) creates both lazily at the first step, so before it
    ``safe_set_full_optimizer_state`` has nothing to write into; these are the same calls its step makes."""
    from deepspeed.utils import lazy_init_hp_params_optimizer_state

    if not hasattr(zero, "single_partition_of_fp32_groups") or not hasattr(zero, "bit16_groups"):
        raise CheckpointError(f"a universal checkpoint resumes under DeepSpeed ZeRO stage 1 or 2 only (the engine's "
                              f"optimizer is {type(zero).__name__})")
    adam = zero.optimizer
    for flat in zero.single_partition_of_fp32_groups:
        adam.state[flat] = {"step": torch.tensor(float(step)), "exp_avg": torch.zeros_like(flat),
                            "exp_avg_sq": torch.zeros_like(flat)}
    for lp_params, flat in zip(zero.bit16_groups, zero.single_partition_of_fp32_groups):
        lazy_init_hp_params_optimizer_state(lp_params, flat, adam.state)
    zero._hp_optimizer_states_linked = True


def load_universal_training_state(engine, load_dir, tag: str, *, pp_rank: int, stage_layers: list[range],
                                  load_optimizer_states: bool = True):
    """After ``deepspeed.initialize``: Adam moments and step (unless ``load_optimizer_states`` is False:
    --no-load-optim), LR schedule, counters. Returns the TrainState."""
    from deepspeed.utils import safe_set_full_optimizer_state

    meta = read_universal_meta(load_dir, tag)
    model = engine.module
    if load_optimizer_states:
        _create_adam_state(engine.optimizer, meta["adam_step"])
        for state in STATES[1:]:
            shard = _stage_shard(load_dir, tag, state, model.config, model.tp_size, model.tp_rank, pp_rank,
                                 stage_layers)
            for name, param in model.named_parameters():
                safe_set_full_optimizer_state(param, shard[name].to(param.device), state)
    engine.lr_scheduler.load_state_dict(meta["lr_scheduler"])
    engine.global_steps, engine.global_samples = meta["global_steps"], meta["global_samples"]
    engine.skipped_steps = meta["skipped_steps"]
    fields = {f.name for f in dataclasses.fields(TrainState)}
    return TrainState(**{k: v for k, v in meta["train_state"].items() if k in fields})

