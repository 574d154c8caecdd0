"""Training checkpoints through DeepSpeed, in the layout of ``checkpoint/files.py``.

DeepSpeed writes the model file of each model-parallel rank (with our metadata and training state as
client state) and the ZeRO optimizer partitions of every rank. ``latest`` is written by us, last and
atomically, after a barrier: a process killed mid-save leaves ``latest`` at the previous complete tag.
"""

from __future__ import annotations

import dataclasses
import os

import torch.distributed as dist

from codegeex_train.checkpoint.files import META_KEY, checkpoint_tag, write_latest
from codegeex_train.checkpoint.safe_load import CheckpointError
from codegeex_train.checkpoint.train_state import TrainState, rng_state, set_rng_state
from codegeex_train.config.model import ModelConfig
from codegeex_train.distributed.topology import Topology
from codegeex_train.tensor_parallel import RNGStatesTracker


def save_checkpoint(engine, save_dir: str, state: TrainState, config: ModelConfig, topology: Topology,
                    tracker: RNGStatesTracker, *, tokenizer: dict | None = None) -> str:
    """``tokenizer``: the run's tokenizer settings (``files.tokenizer_settings``), recorded for the tools."""
    tag = checkpoint_tag(state.iteration)
    state = dataclasses.replace(state, rng=rng_state(tracker))
    meta = {"model_config": dataclasses.asdict(config), "tp_size": topology.tp_size, "pp_size": topology.pp_size,
            "iteration": state.iteration, "train_state": dataclasses.asdict(state)}
    if tokenizer is not None:
        meta["tokenizer"] = tokenizer
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


def load_checkpoint(engine, load_dir: str, tag: str, tracker: RNGStatesTracker, *, load_optimizer_states: bool = True,
                    load_rng: bool = True) -> TrainState:
    """Resume model, optimizer, LR schedule, consumed samples and RNG states from a training checkpoint.

    ``load_optimizer_states=False`` (--no-load-optim): the optimizer starts afresh (no Adam moments, its step count
    from 0) while the weights, LR schedule and counters are restored. DeepSpeed (0.19.8, ``engine.load_checkpoint``)
    then skips the ZeRO partition files altogether and rebuilds ZeRO-1/2's fp32 master partitions from the loaded
    model weights (``_restore_from_bit16_weights``: each DP rank copies its slice of the flat weight buffer), so the
    first step updates the loaded weights, not the initial ones; and the ZeRO files' DP size need not be this run's.
    ``load_rng=False`` (--no-load-rng): the random-number streams stay as this run seeded them."""
    _, client = engine.load_checkpoint(load_dir, tag=tag, load_optimizer_states=load_optimizer_states,
                                       load_lr_scheduler_states=True)
    if client is None or "train_state" not in client.get(META_KEY, {}):
        raise CheckpointError(f"--load {load_dir} ({tag}): DeepSpeed found no training state to resume")
    state = TrainState(**client[META_KEY]["train_state"])
    if load_rng:
        set_rng_state(state.rng, tracker)
    return state
