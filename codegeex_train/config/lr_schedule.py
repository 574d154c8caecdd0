"""What the learning-rate schedule is, as the flags give it and as a checkpoint records it, and the resume rule.

Megatron's rule (``OptimizerParamScheduler.load_state_dict``): on resume the schedule's values in the checkpoint must
equal the flags' unless one of two flags decides: ``--override-opt_param-scheduler`` (the flags' values win; the
position is the checkpoint's) or ``--use-checkpoint-opt_param-scheduler`` (the checkpoint's values win). Without
either, a mismatch is refused, naming both values: a run continued with another ``--train-iters`` would otherwise
decay over the new length and its LR jump (``--lr-decay-iters`` defaults to ``--train-iters``). Extending a run keeps
the decay where it was set: ``--train-iters`` larger, ``--lr-decay-iters`` the old length (docs/checkpoints.md).

The global batch is part of the comparison too (Megatron compares its decay in samples): with the iteration-counted
schedule here, either flag accepts a new global batch, which stays the flags' in both cases.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum

# A mismatch is refused unless one of these (Megatron's spellings) is given.
OVERRIDE_FLAG = "--override-opt_param-scheduler"
USE_CHECKPOINT_FLAG = "--use-checkpoint-opt_param-scheduler"


class SchedulePolicy(Enum):
    """What a resume does when the checkpoint's schedule differs from the flags'."""

    CHECK = "check"  # refuse (the default)
    OVERRIDE = "override"  # the flags' values
    USE_CHECKPOINT = "checkpoint"  # the checkpoint's values


@dataclass(frozen=True)
class LRScheduleShape:
    """The schedule's values (not its position): linear warm-up to ``max_lr`` over ``warmup_iters``, then ``style``
    decay to ``min_lr`` at ``decay_iters``; ``global_batch_size`` samples per iteration (None: not recorded, from a
    checkpoint written before it was)."""

    max_lr: float
    min_lr: float
    warmup_iters: int
    decay_iters: int
    style: str
    global_batch_size: int | None = None

    @classmethod
    def from_flags(cls, optim, train_iters: int, global_batch_size: int | None = None) -> "LRScheduleShape":
        """The schedule an ``OptimConfig`` gives a run of ``train_iters`` (--lr-decay-iters defaults to it; a
        --lr-warmup-fraction is of the decay)."""
        decay_iters = optim.lr_decay_iters or train_iters
        warmup = (round(optim.lr_warmup_fraction * decay_iters) if optim.lr_warmup_fraction is not None
                  else optim.lr_warmup_iters)
        return cls(optim.lr, optim.min_lr, warmup, decay_iters, optim.lr_decay_style, global_batch_size)

    @classmethod
    def from_state(cls, state: object) -> "LRScheduleShape | None":
        """From ``LRSchedule.state_dict()`` as a checkpoint holds it; None when it holds no such values."""
        keys = ("max_lr", "min_lr", "warmup_iters", "decay_iters", "style")
        if not isinstance(state, dict) or not all(k in state for k in keys):
            return None
        return cls(*(state[k] for k in keys), state.get("global_batch_size"))

    def state(self) -> dict:
        return dataclasses.asdict(self)

    def flags(self) -> dict:
        """The OptimConfig fields that give this schedule (for ``dataclasses.replace``)."""
        return {"lr": self.max_lr, "min_lr": self.min_lr, "lr_warmup_iters": self.warmup_iters,
                "lr_warmup_fraction": None, "lr_decay_iters": self.decay_iters, "lr_decay_style": self.style}


# Each value, with the flag(s) that set it.
_FLAGS = {"max_lr": "--lr", "min_lr": "--min-lr", "warmup_iters": "--lr-warmup-iters / --lr-warmup-fraction",
          "decay_iters": "--lr-decay-iters (default: --train-iters)", "style": "--lr-decay-style",
          "global_batch_size": "--global-batch-size"}


def schedule_differences(saved: LRScheduleShape, ours: LRScheduleShape) -> list[str]:
    """Each value that differs, as 'name: checkpoint X, these flags Y (flag)'; a value the checkpoint did not record
    is not compared."""
    out = []
    for name, flag in _FLAGS.items():
        theirs, mine = getattr(saved, name), getattr(ours, name)
        if theirs is not None and theirs != mine:
            out.append(f"{name} {theirs} in the checkpoint, {mine} by these flags ({flag})")
    return out


def extend_hint(saved: LRScheduleShape, ours: LRScheduleShape) -> str:
    """The flag that keeps the checkpoint's decay, when the decay moved (a longer --train-iters moves it)."""
    if saved.decay_iters == ours.decay_iters:
        return ""
    return f"To extend the run with the schedule it had, keep its decay: --lr-decay-iters {saved.decay_iters}"
