"""What a resume needs beyond the model, optimizer and LR schedule (which DeepSpeed saves): the counters and
the random-number streams."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import torch

from codegeex_train.tensor_parallel import RNGStatesTracker


@dataclass
class TrainState:
    """Saved in every training checkpoint (as DeepSpeed client state) and returned by a restore."""

    iteration: int = 0
    consumed_train_samples: int = 0
    wandb_run_id: str | None = None
    rng: dict = field(default_factory=dict)
    # Who wrote a checkpoint (checkpoint/run_dir.py): new for every run started (from scratch, --finetune,
    # --start-over), kept by every resume; a checkpoint saved before it existed gets a new one when resumed.
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex)


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
