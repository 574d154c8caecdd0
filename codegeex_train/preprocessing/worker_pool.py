"""Worker processes for preprocessing: batches in, results out in submission order, and a dead worker reported.

concurrent.futures rather than multiprocessing.Pool: when a worker dies (the OOM killer's SIGKILL) the pool
breaks and every pending result raises at once; Pool silently replaces the worker and waits forever for the lost
batch. Each ``imap`` keeps at most ``2 * workers`` batches in flight, so a huge corpus is not read ahead into
memory; several ``imap`` streams may share one pool (deduplication's fingerprints feed the tokenizer's input).
"""

from __future__ import annotations

import collections
import contextlib
import signal
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

INTERRUPTS = {signal.SIGINT, signal.SIGTERM}

BATCH_CHARS = 1 << 20
"""A batch closes at its size in items or this many characters, whichever comes first: together with the document
limit it bounds what one worker holds (about 400 MB at the defaults)."""


class WorkerDiedError(RuntimeError):
    """A worker process died (killed by a signal, e.g. the out-of-memory killer)."""


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """Ctrl-C and SIGTERM wait for the end of the block: for steps that must not be cut in two."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, INTERRUPTS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def death_cause(exit_codes: list[int | None]) -> str:
    """How a pool's worker died, from its workers' exit codes (-N: killed by signal N)."""
    # The pool terminates (SIGTERM) the survivors itself, so any other code is the first death.
    died = [c for c in exit_codes if c not in (None, 0, -signal.SIGTERM)]
    code = died[0] if died else (-signal.SIGTERM if -signal.SIGTERM in exit_codes else None)
    if code is None:
        return "it exited unexpectedly"
    if code > 0:
        return f"exit code {code}"
    try:
        return f"killed by signal {-code} ({signal.Signals(-code).name})"
    except ValueError:
        return f"killed by signal {-code}"


def batches(items: Iterable[Any], size: int, max_chars: int, chars: Callable[[Any], int] = len) -> Iterator[list]:
    """``items`` in lists of ``size``, or fewer when their ``chars`` reach ``max_chars``."""
    batch: list = []
    total = 0
    for item in items:
        batch.append(item)
        total += chars(item)
        if len(batch) == size or total >= max_chars:
            yield batch
            batch, total = [], 0
    if batch:
        yield batch


class OrderedPool:
    """``workers`` processes, each set up by ``initializer(*initargs)``; ``imap`` maps a function over batches.

    ``died_hint`` ends the WorkerDiedError message (what to lower)."""

    def __init__(self, workers: int, initializer: Callable, initargs: tuple, died_hint: str):
        self._executor = ProcessPoolExecutor(workers, initializer=initializer, initargs=initargs)
        # The first task starts every worker. Ctrl-C or SIGTERM during a fork() would be raised in
        # an at-fork hook, where Python prints and drops it (the run went on): hold them back.
        with interrupts_held():
            self._executor.submit(int)
        self._window = 2 * workers
        self._died_hint = died_hint

    def imap(self, function: Callable[[Any], Any], batches: Iterable[Any]) -> Iterator[Any]:
        pending: collections.deque[Future] = collections.deque()
        try:
            for batch in batches:
                pending.append(self._executor.submit(function, batch))
                if len(pending) > self._window:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        except BrokenProcessPool:
            processes = self._processes()
            self._executor.shutdown(wait=True, cancel_futures=True)  # it has stopped the others
            cause = death_cause([process.exitcode for process in processes])
            raise WorkerDiedError(f"a tokenizer worker died ({cause}: out of memory? {self._died_hint}); "
                                  "nothing was written") from None

    def close(self, ok: bool) -> None:
        """Let idle workers exit after a complete run; otherwise stop them at once."""
        if ok:
            self._executor.shutdown(wait=True)
        else:
            self._stop()

    def _stop(self) -> None:
        """Kill the workers (a batch may take seconds) and wait for them."""
        for process in self._processes():
            process.kill()
        self._executor.shutdown(wait=True, cancel_futures=True)

    def _processes(self) -> list[Any]:
        # The executor's {pid: Process}; no public accessor before Python 3.14 (terminate_workers).
        return list((getattr(self._executor, "_processes", None) or {}).values())
