"""The run's checkpoints as the training loop sees them: one :class:`CheckpointManager`, built once by pretrain.py
from the flags, called by the loop once per step (``step``) and on a numerical-health stop (``finish``). It holds
together, each part's rules staying in its own module: the ``--save`` directory's lock for the run's life and
``--start-over`` (``save_lock.py``, ``run_dir.py``); which steps save (every ``--save-interval``, and the last);
how, sync or ``--async-save`` (``async_save.py``), a save being ``deepspeed_checkpoint.write_checkpoint`` (every
rank's files) then ``commit_save`` (``latest``); retention after each commit (``retention.py``); and the
``preempted`` marker after a stop by signal (``run_dir.py``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

from codegeex_train.checkpoint.async_save import AsyncCheckpointer, async_checkpointer
from codegeex_train.checkpoint.deepspeed_checkpoint import commit_save, write_checkpoint
from codegeex_train.checkpoint.files import read_latest
from codegeex_train.checkpoint.retention import apply_retention
from codegeex_train.checkpoint.run_dir import archive_run, clear_preempted_marker, write_preempted_marker
from codegeex_train.checkpoint.safe_load import CheckpointError
from codegeex_train.checkpoint.save_lock import SaveLock, hold_save_dir
from codegeex_train.checkpoint.train_state import TrainState
from codegeex_train.config.arguments import TrainConfig
from codegeex_train.config.model_config import ModelConfig
from codegeex_train.distributed.topology import Topology
from codegeex_train.tensor_parallel import RNGStatesTracker

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Saved:
    """What every save writes (the engine's model and ZeRO state, this rank's RNG streams) and records beside it."""

    engine: object  # deepspeed.DeepSpeedEngine
    model: ModelConfig
    topology: Topology
    tracker: RNGStatesTracker
    num_chunks: int
    tokenizer: dict | None  # files.tokenizer_settings
    resolved_config: str | None  # config_file.dump_resolved
    wandb_run_id: str | None  # a resume logs on to the same wandb run


class CheckpointManager:
    """Saving, sync or async, behind one interface. Built before any process group (``for_run``: the lock, the
    flags), given the engine once it exists (``attach``), then driven by the loop (``step``, ``finish``). Without a
    save directory it saves nothing. Every method that saves or commits is called by every rank alike."""

    def __init__(self, save_dir: str | None = None, *, save_interval: int | None = None, async_save: bool = False,
                 keep_last: int | None = None, keep_every: int | None = None, lock: SaveLock | None = None,
                 environ: Mapping[str, str] = os.environ) -> None:
        self.save_dir = save_dir
        self.save_interval = save_interval  # None or 0: only the last iteration saves
        self.keep_last, self.keep_every = keep_last, keep_every  # --keep-last-n-checkpoints, --keep-every-n-iterations
        self._lock = lock  # global rank 0: held as long as this manager (the run) lives, or the process
        self._background: AsyncCheckpointer | None = async_checkpointer(environ) if async_save and save_dir else None
        self._saved: _Saved | None = None
        self._run_id: str | None = None  # of the saves: retention removes only that run's tags
        self._foreign: set[str] = set()  # tags retention has said are not this run's (said once)

    @classmethod
    def for_run(cls, train: TrainConfig, *, rank: int, environ: Mapping[str, str] = os.environ) -> CheckpointManager:
        """The run's manager, before any process group: global rank 0 (``rank``) takes ``--save``'s lock
        (``SaveLockError`` when another run holds it) and, under ``--start-over``, moves the run there aside before
        anything new is written."""
        lock = hold_save_dir(train.save) if train.save and rank == 0 else None
        if lock is not None and train.start_over:
            archived = archive_run(train.save)
            if archived is not None:
                logger.info(f"--start-over: the run in --save {train.save} was moved to {archived} (nothing deleted; "
                            f"--load {archived} resumes it); a relaunch of this command would start over again")
        return cls(train.save, save_interval=train.save_interval, async_save=train.async_save,
                   keep_last=train.keep_last_n_checkpoints, keep_every=train.keep_every_n_iterations, lock=lock,
                   environ=environ)

    def attach(self, engine, model: ModelConfig, topology: Topology, tracker: RNGStatesTracker, *, num_chunks: int = 1,
               tokenizer: dict | None = None, resolved_config: str | None = None,
               wandb_run_id: str | None = None) -> None:
        """What every save writes and records, once the engine exists (just before training starts): a
        ``preempted`` marker left by a stop by signal is removed, since this run goes on from there."""
        self._saved = _Saved(engine, model, topology, tracker, num_chunks, tokenizer, resolved_config, wandb_run_id)
        if self.save_dir and topology.rank == 0:
            clear_preempted_marker(self.save_dir)

    def saves_at(self, iteration: int) -> bool:
        """Whether ``iteration`` saves on schedule (every ``--save-interval``); the last iteration saves as well."""
        return bool(self.save_dir and self.save_interval and iteration % self.save_interval == 0)

    def step(self, state: TrainState, *, last: bool = False, preempted: bool = False) -> str | None:
        """The step boundary's checkpoint work; returns the tag that became ``latest`` here (None: none). First the
        async save in flight is committed if every rank has written it (``last``: waiting for it); then the step saves
        on schedule or at ``last``. Stopped by a signal (``preempted``) with a save in flight, that save is the one
        that completes: the kill window is spent on one write, not two; rank 0 then writes the ``preempted`` marker."""
        if not self.save_dir:
            return None
        committed = self.commit(wait=last)
        if (last or self.saves_at(state.iteration)) and not (preempted and committed is not None):
            committed = self.save(state, wait=last) or committed
        if preempted and self._saved.topology.rank == 0:  # after `latest` names it, before the stop's log line
            write_preempted_marker(self.save_dir, committed)
        return committed

    def save(self, state: TrainState, *, wait: bool = False) -> str | None:
        """Save the iteration ``state`` is at, now; returns the tag that became ``latest`` here. Sync: this save's, once
        written and committed. Async: a save still in flight is committed first (at most one in flight), then this
        one is snapshotted and queued: None, or (``wait``) written and committed, its tag."""
        saved, background = self._saved, self._background
        committed = self.commit(wait=True)  # (sync: nothing in flight)
        state.wandb_run_id = saved.wandb_run_id
        self._run_id = state.run_id
        tag, failure = write_checkpoint(saved.engine, self.save_dir, state, saved.model, saved.topology, saved.tracker,
                                        tokenizer=saved.tokenizer, num_chunks=saved.num_chunks,
                                        resolved_config=saved.resolved_config,
                                        background=background.writer if background else None)
        if background is None:
            commit_save(self.save_dir, tag, failure)
            self._retain()
            return tag
        return self.commit(wait=True) if wait else committed

    def commit(self, *, wait: bool = False) -> str | None:
        """--async-save: the save in flight becomes ``latest`` once every rank has written it (``wait``: waiting for
        this rank's write), then retention; returns its tag, or None (nothing in flight, or some rank still writing).
        Collective while a save is in flight. A failed write is one ``error:`` line and ``CheckpointSaveError`` on
        every rank (``deepspeed_checkpoint.commit_save``). Sync saves commit themselves: None."""
        if self._background is None:
            return None
        tag = self._background.commit(wait=wait)
        if tag is not None:
            self._retain()
        return tag

    def finish(self) -> str | None:
        """Nothing in flight after this: the save being written (of an earlier, checked iteration) completes and
        becomes ``latest``; its tag, or None. For a stop that saves nothing (a numerical-health error); ``step`` with
        ``last`` finishes too."""
        return self.commit(wait=True)

    @property
    def writing(self) -> bool:  # (benchmarks/checkpoint.py)
        pending = self._background.writer.pending if self._background else None
        return pending is not None and not pending.done.is_set()

    @property
    def last_write_seconds(self) -> float | None:  # the last committed async save's, snapshot to fsync
        return self._background.last_write_seconds if self._background else None

    def last_good(self) -> str:
        """The checkpoint a relaunch would resume from, in words (for a stop that saves nothing)."""
        if not self.save_dir:
            return "none (no --save)"
        if not os.path.lexists(os.path.join(self.save_dir, "latest")):
            return f"none ({self.save_dir} has no 'latest')"
        try:  # never follows a link, never echoes what is not a tag
            tag = read_latest(self.save_dir)
        except CheckpointError as e:
            return f"unknown ({e})"
        return f"{tag} in {self.save_dir} (relaunch with --load {self.save_dir} to resume from it)"

    def _retain(self) -> None:
        """Retention after a commit (global rank 0, under --keep-last-n-checkpoints), of the saving run's tags."""
        if self.keep_last and self._saved.topology.rank == 0:
            apply_retention(self.save_dir, self.keep_last, self.keep_every, run_id=self._run_id,
                            foreign=self._foreign)
