"""The TensorBoard sink (``--tensorboard-dir``): every number of a record as a scalar, named as in wandb.

A record's numbers go in as ``{split}/{name}`` (``train/loss``, ``valid/ppl``, ``memory/total_bytes``: wandb's
names, ``wandb_sink.wandb_key``) at ``step = iteration``, in double precision, so that a value read back equals the
one in metrics.jsonl exactly (TensorBoard's default, float32, would round every loss). Strings and booleans (a record
may carry a few, e.g. the memory record's recompute mode) are not scalars and stay in the file and wandb.

Megatron's switches: ``--tensorboard-log-interval N`` keeps the train records of iterations divisible by N (other
splits always go in); ``--no-log-learning-rate-to-tensorboard`` (Megatron: ``--no-log-learnig-rate-...``),
``--no-log-loss-scale-to-tensorboard`` and ``--no-log-gradient-norm-to-tensorboard`` leave those scalars out;
``--tensorboard-queue-size`` is the writer's queue. A resumed run (start iteration T) marks a session start at T + 1:
TensorBoard's reader then drops what an earlier run wrote after T, so the charts show the steps that count, as
metrics.jsonl's last line of an iteration does.
"""

from __future__ import annotations

import os

from codegeex_train.metrics.wandb_sink import wandb_key


class TensorBoardSink:
    """Writes each record's numbers through ``torch.utils.tensorboard.SummaryWriter``; ``close`` flushes them."""

    def __init__(self, log_dir: str | os.PathLike, *, queue_size: int = 1000, log_interval: int = 1,
                 exclude: frozenset[str] = frozenset(), start_iteration: int = 0) -> None:
        # Imported here: only the logging rank of a run with --tensorboard-dir pays for tensorboard's import.
        from torch.utils.tensorboard import SummaryWriter

        self.log_interval = log_interval
        self.exclude = exclude  # train-record keys left out (the --no-log-*-to-tensorboard switches)
        # A session start at the first step to come: a reader drops what an earlier run wrote from there on (a
        # fresh run's start is the first one it sees, which drops nothing).
        self.writer = SummaryWriter(os.fspath(log_dir), max_queue=queue_size, purge_step=start_iteration + 1)

    def write(self, record: dict) -> None:
        split, step = record.get("split", "train"), record["iteration"]
        if split == "train" and step % self.log_interval:
            return
        for key, value in record.items():
            if key in ("iteration", "split") or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if split == "train" and key in self.exclude:
                continue
            self.writer.add_scalar(wandb_key(key, split), value, global_step=step, new_style=True,
                                   double_precision=True)

    def close(self) -> None:
        self.writer.close()
