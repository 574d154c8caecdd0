"""Training checkpoints through DeepSpeed, in the layout of ``model/checkpoint.py``.

DeepSpeed writes the model file of each model-parallel rank (with our metadata and training state as
client state) and the ZeRO optimizer partitions of every rank. ``latest`` is written by us, last and
atomically, after a barrier: a process killed mid-save leaves ``latest`` at the previous complete tag.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..arguments import ConfigError
from ..model.checkpoint import (
    META_KEY,
    SHAPE_FIELDS,
    CheckpointError,
    read_checkpoint_meta,
    read_latest,
    write_latest,
)
from ..model.config import ModelConfig
from ..safe_load import verify_checkpoint_dir
from ..tensor_parallel import RNGStatesTracker
from ..topology import ParallelDims, Topology
from .universal import is_universal, read_universal_meta


@dataclass
class TrainState:
    """What a resume needs beyond model, optimizer and LR schedule (which DeepSpeed saves)."""

    iteration: int = 0
    consumed_train_samples: int = 0
    wandb_run_id: str | None = None
    rng: dict = field(default_factory=dict)


def checkpoint_tag(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def _shape(config: ModelConfig | dict) -> dict:
    get = config.get if isinstance(config, dict) else lambda k: getattr(config, k)
    return {k: get(k) for k in SHAPE_FIELDS}


_TO_UNIVERSAL = ("to resume at another layout, convert it first: python tools/convert_checkpoint.py --load {d} "
                 "--to-universal OUT, then --load OUT")


def _check_same_model(load_dir: str, tag: str, stored: ModelConfig, config: ModelConfig) -> None:
    ours, theirs = _shape(config), _shape(stored)
    if ours != theirs:
        diff = "; ".join(f"{k}: checkpoint {theirs[k]}, this run {ours[k]}" for k in ours if ours[k] != theirs[k])
        raise ConfigError(f"--load {load_dir} ({tag}) was saved from a different model ({diff}): use the same "
                          f"model flags")


def preflight_load(load_dir: str, config: ModelConfig, dims: ParallelDims) -> dict:
    """Check ``--load`` before any process group: a complete checkpoint of this model shape, saved at this
    run's TP / PP / DP sizes, or a universal one (any layout). Returns its metadata (``universal``: which)."""
    try:
        tag = read_latest(load_dir)
        verify_checkpoint_dir(load_dir, tag)  # weights-only, before DeepSpeed unpickles any of its files
        if is_universal(load_dir, tag):
            meta = read_universal_meta(load_dir, tag)
            _check_same_model(load_dir, tag, ModelConfig(**meta["model_config"]), config)
            return {"tag": tag, "universal": True, **meta}
        tag, meta = read_checkpoint_meta(load_dir)
    except CheckpointError as e:
        raise ConfigError(f"--load {load_dir}: {e}") from None
    _check_same_model(load_dir, tag, ModelConfig(**meta["model_config"]), config)
    saved = {"TP": meta["tp_size"], "PP": meta["pp_size"]}
    if has_optimizer_states(load_dir, tag):  # ZeRO partitions the optimizer state by DP rank as well
        saved["DP"] = sum(name.startswith(("zero_pp_rank_", "bf16_zero_pp_rank_")) and "_mp_rank_00_" in name
                          for name in os.listdir(os.path.join(load_dir, tag)))
    ours = {"TP": dims.tp_size, "PP": dims.pp_size, "DP": dims.dp_size}
    diff = [k for k in saved if saved[k] != ours[k]]
    if diff:
        layout = ", ".join(f"{k} {saved[k]} (this run {ours[k]})" for k in diff)
        hint = _TO_UNIVERSAL.format(d=load_dir) if "DP" in saved else (
            "tools/convert_checkpoint.py re-shards these model weights to another TP and PP size")
        raise ConfigError(f"--load {load_dir} ({tag}) was saved at another parallel layout: {layout}; {hint}")
    return {"tag": tag, "universal": False, **meta}


def rng_state(tracker: RNGStatesTracker) -> dict:
    state = {"cpu": torch.get_rng_state(), "tracker": tracker.get_states()}
    if tracker.device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(tracker.device)
    return state


def set_rng_state(state: dict, tracker: RNGStatesTracker) -> None:
    torch.set_rng_state(state["cpu"])
    tracker.set_states(state["tracker"])
    if "cuda" in state and tracker.device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], tracker.device)


def save_checkpoint(engine, save_dir: str, state: TrainState, config: ModelConfig, topology: Topology,
                    tracker: RNGStatesTracker) -> str:
    tag = checkpoint_tag(state.iteration)
    state = dataclasses.replace(state, rng=rng_state(tracker))
    meta = {"model_config": dataclasses.asdict(config), "tp_size": topology.tp_size, "pp_size": topology.pp_size,
            "iteration": state.iteration, "train_state": dataclasses.asdict(state)}
    engine.save_checkpoint(save_dir, tag=tag, client_state={META_KEY: meta}, save_latest=False)
    dist.barrier()  # every rank's files are on disk before the tag becomes the one to load
    if dist.get_rank() == 0:
        write_latest(save_dir, tag)
    dist.barrier()
    return tag


def has_optimizer_states(load_dir: str, tag: str) -> bool:
    """False for a model-only checkpoint (e.g. converted from Hugging Face): load it into the model before
    ``deepspeed.initialize`` and start the training state afresh."""
    return any(name.endswith("optim_states.pt") for name in os.listdir(os.path.join(load_dir, tag)))


def load_checkpoint(engine, load_dir: str, tag: str, tracker: RNGStatesTracker) -> TrainState:
    """Resume model, optimizer, LR schedule, consumed samples and RNG states from a training checkpoint."""
    _, client = engine.load_checkpoint(load_dir, tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True)
    if client is None or "train_state" not in client.get(META_KEY, {}):
        raise CheckpointError(f"--load {load_dir} ({tag}): DeepSpeed found no training state to resume")
    state = TrainState(**client[META_KEY]["train_state"])
    set_rng_state(state.rng, tracker)
    return state
