"""torch.profiler traces and CUDA memory snapshots of chosen iterations (``--profile``, ``--record-memory-history``).

Iterations are numbered as logged. As in Megatron, profiling starts after iteration ``--profile-step-start`` N and
stops after ``--profile-step-end`` M: the trace holds iterations N+1 .. M (defaults 10, 12: iterations 11 and 12), each
a ``ProfilerStep#<iteration>`` span around its forward, backward and optimizer step. The profiler is set up after
iteration N (Megatron's warm-up step), so its start-up cost stays out of the traced steps. On the ranks of
``--profile-ranks`` (default 0) the trace goes to ``<tensorboard-dir or save>/profile/rank<R>.<ns>.pt.trace.json``
(``torch.profiler.tensorboard_trace_handler``): Chrome trace JSON, which Perfetto (ui.perfetto.dev), chrome://tracing
and TensorBoard's PyTorch profiler plugin open. CPU activity always, CUDA kernels on GPUs; shapes recorded, no
Python stacks.

``--record-memory-history`` (CUDA only) records every allocation from start-up (before the model is built) and dumps a
snapshot after iteration M (or when the run ends before it) to ``--memory-snapshot-path`` (default
``<dir>/profile/memory_snapshot_rank<R>.pickle``), for pytorch.org/memory_viz. On a CPU run it says so in one
warning and does nothing else.

The loop calls ``step(iteration)`` around each training step and ``after_step(iteration)`` once the step is timed (the
warm-up and the writing stay out of the logged iteration times); ``close()`` (also after an error or a preemption
stop) writes what a cut-short window recorded and stops the recording.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Iterator

import torch

from codegeex_train.config.arguments import LoggingConfig

logger = logging.getLogger(__name__)

MAX_MEMORY_EVENTS = 100_000  # allocation events the history keeps (Megatron's)


class Profiling:
    """This rank's profiler window and memory history. ``trace_dir`` None: no trace; ``snapshot_path`` None: no
    memory history."""

    def __init__(self, *, start: int, end: int, device: torch.device, rank: int, trace_dir: str | None = None,
                 snapshot_path: str | None = None) -> None:
        self.start, self.end, self.device, self.rank = start, end, device, rank
        self.trace_dir = trace_dir
        self.snapshot_path = snapshot_path if device.type == "cuda" else None
        self._profiler: torch.profiler.profile | None = None
        self._recording = False  # the profiler collects events (iterations start+1 .. end)
        self._history = False  # CUDA memory history is on
        if snapshot_path is not None and device.type != "cuda":
            logger.warning("--record-memory-history: this run's device is %s; allocation history needs CUDA, so "
                           "no memory snapshot is written", device.type)

    @classmethod
    def from_config(cls, cfg: LoggingConfig, save: str | None, rank: int, device: torch.device) -> Profiling | None:
        """From ``LoggingConfig`` (checked by its ``check``); None on a rank with nothing to do."""
        if not (cfg.profile or cfg.record_memory_history) or rank not in cfg.profile_ranks:
            return None
        base = os.path.join(cfg.tensorboard_dir or save or "", "profile")
        snapshot = None
        if cfg.record_memory_history:
            snapshot = cfg.memory_snapshot_path or os.path.join(base, f"memory_snapshot_rank{rank}.pickle")
            if cfg.memory_snapshot_path and len(set(cfg.profile_ranks)) > 1:
                stem, ext = os.path.splitext(snapshot)
                snapshot = f"{stem}_rank{rank}{ext}"
        return cls(start=cfg.profile_step_start, end=cfg.profile_step_end, device=device, rank=rank,
                   trace_dir=base if cfg.profile else None, snapshot_path=snapshot)

    def begin(self) -> None:
        """Start the memory history (call before the model is built, so its allocations are in the snapshot)."""
        if self.snapshot_path is not None:
            # Python stacks only: C++ ones make the dump take minutes to symbolise (Megatron's choice too).
            torch.cuda.memory._record_memory_history(max_entries=MAX_MEMORY_EVENTS, stacks="python")
            self._history = True

    @contextlib.contextmanager
    def step(self, iteration: int) -> Iterator[None]:
        """Wraps training step ``iteration`` (its logged number): recording, under its ``ProfilerStep#`` span, when
        it lies in the window."""
        traced = self.trace_dir is not None and self.start < iteration <= self.end
        if traced and self._profiler is None:  # a resumed run may begin inside the window: no warm-up then
            self._prepare()
        if traced and not self._recording:
            self._profiler.start_trace()
            self._recording = True
        with torch.profiler.record_function(f"ProfilerStep#{iteration}") if traced else contextlib.nullcontext():
            yield

    def after_step(self, iteration: int) -> None:
        """After step ``iteration`` and its timing: the warm-up after N, the trace and snapshot after M."""
        if self.trace_dir is not None and iteration == self.start and self._profiler is None:
            self._prepare()
        if iteration >= self.end:
            self.close()

    def _prepare(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(activities=activities, record_shapes=True, with_stack=False)
        self._profiler.prepare_trace()

    def close(self) -> None:
        """Write the trace and the snapshot if not written yet; stop recording. Safe to call again."""
        if self._recording:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the window's kernels end inside the trace
            self._profiler.stop_trace()
            torch.profiler.tensorboard_trace_handler(self.trace_dir, worker_name=f"rank{self.rank}")(self._profiler)
            self._recording = False
            self.trace_dir = None  # one window per run
        if self._history:
            os.makedirs(os.path.dirname(os.path.abspath(self.snapshot_path)), exist_ok=True)
            torch.cuda.memory._dump_snapshot(self.snapshot_path)
            torch.cuda.memory._record_memory_history(enabled=None)
            self._history = False
