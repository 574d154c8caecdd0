"""Resumable distributed batch sampler (Megatron's ``MegatronPretrainingSampler``) and loader.

The dataset is already shuffled (GPTDataset's shuffle_idx), so the global order is simply
0, 1, 2, ...: global step s covers samples ``[s * G, (s + 1) * G)`` with
``G = micro_batch_size * dp_size``, and DP rank r takes the contiguous slice
``[r * micro_batch_size, (r + 1) * micro_batch_size)`` of it. Resuming is starting at
``consumed_samples`` (saved in the checkpoint); nothing else has state.

The loader's worker processes leave the job's stop signals to their rank: SLURM (preemption, time limit), a
launcher's process-tree kill (DeepSpeed's, torchrun's) or ``kill -- -PGID`` signal every process of a job, and a
worker that died of SIGTERM would end the rank with "DataLoader worker ... killed by signal" before it saves. A
worker ignores SIGINT, and SIGTERM from anyone but its rank; SIGTERM from its rank (the DataLoader's own shutdown,
multiprocessing's at exit) still ends it at once, and it exits within seconds of its rank's death (the DataLoader's
watchdog), SIGKILL included.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from typing import Iterator

import torch

__all__ = ["PretrainingSampler", "build_pretraining_data_loader"]


class PretrainingSampler:
    """Yields this DP rank's micro-batches (lists of dataset indices) from ``consumed_samples``."""

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        drop_last: bool = True,
    ) -> None:
        if total_samples <= 0:
            raise ValueError(f"total_samples must be > 0, got {total_samples} (empty dataset?)")
        if not 0 <= consumed_samples < total_samples:
            raise ValueError(
                f"consumed_samples {consumed_samples} must be in [0, total_samples={total_samples}): "
                "the checkpoint has consumed the whole dataset; raise --train-samples/--train-iters"
            )
        if micro_batch_size <= 0:
            raise ValueError(f"--micro-batch-size must be > 0, got {micro_batch_size}")
        if dp_size <= 0 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"data-parallel rank {dp_rank} is not in [0, dp_size={dp_size})")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.drop_last = drop_last

    @property
    def global_step_size(self) -> int:
        return self.micro_batch_size * self.dp_size

    def __len__(self) -> int:
        """Micro-batches this rank will yield."""
        remaining = self.total_samples - self.consumed_samples
        full, rest = divmod(remaining, self.global_step_size)
        return full + (1 if rest and not self.drop_last else 0)

    def __iter__(self) -> Iterator[list[int]]:
        step = self.global_step_size
        lo = self.dp_rank * self.micro_batch_size
        start = self.consumed_samples
        while start + step <= self.total_samples:
            yield list(range(start + lo, start + lo + self.micro_batch_size))
            start += step
        # As Megatron: the last partial step is split the same way, so trailing ranks may get a
        # short or empty list; keep drop_last=True for training, where every rank must step.
        if start < self.total_samples and not self.drop_last:
            yield list(range(min(start + lo, self.total_samples),
                             min(start + lo + self.micro_batch_size, self.total_samples)))


# The signals a cluster or a launcher sends every process of a job to stop it; the rank handles them
# (training/exit_conditions.py: finish the iteration, save, exit 0), its loader's workers must outlive them.
JOB_STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})


def leave_stop_signals_to_the_rank(worker_id: int) -> None:
    """``worker_init_fn``: in a worker, ignore SIGINT, and SIGTERM unless its rank sent it.

    PyTorch's own SIGTERM handler in a worker exits quietly when the parent sends it and dies of the signal
    otherwise; ignoring SIGTERM outright (SIG_IGN) would make multiprocessing's exit, which terminates daemonic
    workers and then joins them without a timeout, hang whenever a worker outlives its iterator (an exception's
    traceback holding it). So SIGTERM stays blocked (the loader starts workers with it blocked) and a thread takes
    each one with its sender: the rank's ends the worker as PyTorch's handler does, anyone else's is dropped."""
    parent = multiprocessing.parent_process()  # the rank, whatever the start method (not a forkserver)
    if parent is None:  # a worker thread in the rank itself: the rank's signals are its own
        return
    parent_pid = parent.pid
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # discards one already pending
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # in this thread and the threads started from it
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})

    def take_sigterm() -> None:
        while True:
            if signal.sigwaitinfo({signal.SIGTERM}).si_pid == parent_pid:
                os._exit(0)

    threading.Thread(target=take_sigterm, name="sigterm-from-rank", daemon=True).start()


class _Loader(torch.utils.data.DataLoader):
    """Starts its workers with the stop signals blocked, so none arrives between a worker's start and
    ``leave_stop_signals_to_the_rank`` (a signal for the rank meanwhile waits until the workers are up)."""

    def __iter__(self):
        if self.num_workers == 0:
            return super().__iter__()
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, JOB_STOP_SIGNALS)
        try:
            return super().__iter__()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def build_pretraining_data_loader(
    dataset: torch.utils.data.Dataset,
    consumed_samples: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    num_workers: int = 0,
    total_samples: int | None = None,
) -> torch.utils.data.DataLoader:
    """DataLoader over this rank's micro-batches; batches are ``{"text": LongTensor (b, s + 1)}``. Its workers
    (``num_workers``) ignore stop signals not sent by their rank (``leave_stop_signals_to_the_rank``)."""
    sampler = PretrainingSampler(
        total_samples if total_samples is not None else len(dataset),
        consumed_samples,
        micro_batch_size,
        dp_rank,
        dp_size,
    )
    # Its own generator: creating an iterator draws a base seed for the workers, and drawing it from the default
    # generator would shift the stream that dropout uses (a resume creates its iterators at another point).
    return _Loader(
        dataset, batch_sampler=sampler, num_workers=num_workers, pin_memory=False,
        generator=torch.Generator().manual_seed(0),
        worker_init_fn=leave_stop_signals_to_the_rank if num_workers else None,
    )
