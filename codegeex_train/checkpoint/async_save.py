"""``--async-save``: each rank copies its checkpoint to host memory at the save step and a background thread writes
it while training goes on; ``latest`` moves at a later step boundary, once every rank's files are on disk.

What is saved does not change: DeepSpeed's ``engine.save_checkpoint`` still builds every rank's state dicts (model
file with our client state, ZeRO-2 partitions) and hands each to ``SafeCheckpointEngine.save``, which then calls
:meth:`BackgroundWriter.submit` instead of ``torch.save``. ``submit`` takes a :func:`snapshot` (every tensor storage
copied to host memory, pinned on CUDA) and queues ``torch.save`` of it to the same path: the files are those of a
sync save, byte for byte (tests/checkpoint/test_async_save.py compares them), so resume, conversion and the universal
format read either. The commit (``latest``) is collective and runs on the training thread only
(:class:`AsyncCheckpointer`, driven at step boundaries by the checkpoint manager, ``checkpoint/manager.py``); the
writer thread issues no collective.

Why neither background engine that DeepSpeed 0.19.8 ships, nor torch's:

* ``DecoupledCheckpointEngine`` puts the live state dicts on a multiprocessing queue to a writer process (CPU tensors
  moved into shared memory in place, CUDA tensors by IPC handle): nothing is copied, so the write must end before the
  weights change, and ``engine.step()`` waits for it (plus a barrier, and a non-atomic ``latest``) before the next
  optimizer step: the overlap is one forward/backward at most. A failed write is a RuntimeError at that step with the
  partial directory left. ``FastCheckpointEngine`` is synchronous (faster file I/O through DeepSpeed's writers);
  ``DataStatesCheckpointEngine`` needs the external datastates-llm package.
* ``torch.distributed.checkpoint.async_save`` stages to CPU and writes in a thread, but in DCP's own format (.distcp
  shards and .metadata), which would replace DeepSpeed's ZeRO-2 files rather than write them in the background.

A thread, not a process: the snapshot is already in this process's memory (a process would need it copied again,
into shared memory, or would read live tensors as DeepSpeed's does); the thread spends its time in ``write`` and
``fsync``, which release the GIL (measured: see ``benchmarks/checkpoint.py``); a failure is a Python value the
training thread reads; and a rank killed with -9 takes its writer with it, leaving ``latest`` at the previous
complete checkpoint.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from codegeex_train.checkpoint.deepspeed_checkpoint import all_ranks, commit_save

# Tests only: seconds each background file write sleeps first, so a test can act while a write is in flight
# (``async_checkpointer`` reads it once, when the checkpoint manager is built under --async-save).
TEST_SLOW_WRITE_ENV = "CODEGEEX_TRAIN_TEST_SLOW_ASYNC_WRITE"

Failure = tuple[str, str]  # (what could not be written, the cause), as SafeCheckpointEngine records it

# Location tags of snapshot storages that copy accelerator memory (storage._cdata -> "cuda:0"): a snapshot written
# from host memory records the device its tensors came from, as the sync save's file does.
_ORIGIN: dict[int, str] = {}
_origin_lock = threading.Lock()
_tagger_registered = False


def _origin_tag(storage) -> str | None:
    storage = getattr(storage, "_untyped_storage", storage)
    return _ORIGIN.get(getattr(storage, "_cdata", None))


def _register_origin_tagger() -> None:
    global _tagger_registered
    with _origin_lock:
        if not _tagger_registered:  # before torch's own taggers (cpu is priority 10); only storages we copied match
            torch.serialization.register_package(1, _origin_tag, lambda storage, location: None)
            _tagger_registered = True


class HostBuffers:
    """Host storages reused from one snapshot to the next: a fresh buffer costs its first touch of every page, and
    pinning costs more (measured on CPU, 512 MB: 0.35 s into fresh memory, 0.07 s into reused). It holds one
    checkpoint share per rank between saves."""

    def __init__(self) -> None:
        self._free: dict[tuple[int, bool], list[torch.UntypedStorage]] = {}
        self._lock = threading.Lock()  # taken by the training thread, given back by the writer

    def take(self, nbytes: int, pinned: bool) -> torch.UntypedStorage:
        with self._lock:
            free = self._free.get((nbytes, pinned))
            if free:
                return free.pop()
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned).untyped_storage()

    def give(self, storages: list[torch.UntypedStorage]) -> None:
        with self._lock:
            for s in storages:
                self._free.setdefault((s.nbytes(), s.is_pinned()), []).append(s)


@dataclass
class Snapshot:
    """``obj`` with every tensor storage replaced by a host copy; ``ready`` is recorded after the device-to-host
    copies (None on CPU: they are done)."""

    obj: object
    storages: list[torch.UntypedStorage]
    ready: object = None  # torch.cuda.Event

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()

    def release(self, buffers: HostBuffers) -> None:
        with _origin_lock:
            for s in self.storages:
                _ORIGIN.pop(s._cdata, None)
        buffers.give(self.storages)
        self.storages, self.obj = [], None


def snapshot(obj, buffers: HostBuffers | None = None) -> Snapshot:
    """A copy of ``obj`` as ``torch.save`` would see it now, independent of it: ``obj`` is pickled with every storage
    (what torch.save writes as a record) replaced by a host copy, once per storage, and unpickled again. Views keep
    their offsets into the copied storage, tensors sharing a storage still share one, parameters stay parameters, and
    non-tensor objects (a loss scaler, the client state) are copies as of now. Device storages are copied with
    non_blocking on the current stream (ordered before the next step's kernels); ``Snapshot.wait`` waits for them."""
    buffers = buffers or HostBuffers()
    copies: list[torch.UntypedStorage] = []
    index: dict[int, int] = {}
    on_device = False

    def copy_of(storage: torch.UntypedStorage) -> int:
        nonlocal on_device
        key = storage._cdata
        if key not in index:
            device = storage.device
            copy = buffers.take(storage.nbytes(), pinned=device.type == "cuda")
            copy.copy_(storage, non_blocking=device.type != "cpu")
            if device.type != "cpu":
                on_device = True
                _register_origin_tagger()
                with _origin_lock:
                    _ORIGIN[copy._cdata] = torch.serialization.location_tag(storage)
            index[key] = len(copies)
            copies.append(copy)
        return index[key]

    class _Out(pickle.Pickler):
        def persistent_id(self, o):  # the storages torch.save's persistent_id records
            if isinstance(o, torch.storage.TypedStorage):
                return copy_of(o._untyped_storage), o.dtype
            if isinstance(o, torch.UntypedStorage):
                return copy_of(o), None
            return None

    class _In(pickle.Unpickler):
        def persistent_load(self, pid):
            i, dtype = pid
            if dtype is None:
                return copies[i]
            return torch.storage.TypedStorage(wrap_storage=copies[i], dtype=dtype, _internal=True)

    buf = io.BytesIO()
    _Out(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    ready = None
    if on_device:
        ready = torch.cuda.Event()
        ready.record()
    return Snapshot(_In(io.BytesIO(buf.getvalue())).load(), copies, ready)


@dataclass
class PendingSave:
    """One save being written: ``done`` is set by the writer once every file of it is written and synced, or a
    write failed (``failure``: the first; the save's later files are not written)."""

    save_dir: str
    tag: str
    failure: Failure | None = None
    files: list[str] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    started: float = field(default_factory=time.perf_counter)
    write_seconds: float | None = None  # from the snapshot's start to the last fsync


def _fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):  # some file systems refuse to fsync a directory: the files are synced
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class BackgroundWriter:
    """One daemon thread that writes one save's files at a time, in the order submitted. The training thread calls
    ``begin``, ``submit`` (per file), ``seal``; then polls ``pending.done``."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s  # tests only (TEST_SLOW_WRITE_ENV)
        self.pending: PendingSave | None = None
        self.buffers = HostBuffers()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def begin(self, save_dir: str, tag: str) -> PendingSave:
        if self.pending is not None:
            raise RuntimeError(f"checkpoint {self.pending.tag} is still being written: commit it first")
        self.pending = PendingSave(save_dir, tag)
        return self.pending

    def submit(self, state_dict, path: str, write: Callable[[object, str], Failure | None]) -> None:
        """Snapshot ``state_dict`` now; ``write(snapshot, path)`` runs on the writer thread (None: written and
        synced; else the failure, the partial file removed)."""
        self._put((self.pending, path, snapshot(state_dict, self.buffers), write))

    def seal(self, failure: Failure | None = None) -> None:
        """No more files for the pending save (``failure``: one the training thread met, e.g. a directory it could
        not create); the writer sets ``done`` after the files before."""
        self._put((self.pending, None, failure, None))

    def _put(self, job) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="async-checkpoint-writer", daemon=True)
            self._thread.start()
        self._jobs.put(job)

    def take(self) -> PendingSave:
        pending, self.pending = self.pending, None
        return pending

    def _run(self) -> None:
        while True:
            pending, path, item, write = self._jobs.get()
            if path is None:  # sealed
                pending.failure = pending.failure or item
                if pending.failure is None:
                    for directory in sorted({os.path.dirname(f) for f in pending.files}) + [pending.save_dir]:
                        _fsync_dir(directory)  # the new names, as well as the bytes, survive a crash
                pending.write_seconds = time.perf_counter() - pending.started
                pending.done.set()
                continue
            try:
                if pending.failure is None:  # after a failure nothing more of that save is written
                    item.wait()
                    if self.delay_s:
                        time.sleep(self.delay_s)
                    failure = write(item.obj, path)
                    if failure is None:
                        pending.files.append(path)
                    else:
                        pending.failure = failure
            except Exception as e:  # noqa: BLE001 - anything else a write raises is that save's failure
                pending.failure = (path, " ".join(f"{type(e).__name__}: {e}".split())[:300])
            finally:
                item.release(self.buffers)


class AsyncCheckpointer:
    """The training thread's side: at most one save in flight; ``commit`` (collective, every rank alike) makes it
    ``latest`` once every rank's writer is done, or fails it as a sync save fails (one ``error:`` line, the partial
    directory removed, ``latest`` unchanged, CheckpointSaveError on every rank)."""

    def __init__(self, writer: BackgroundWriter) -> None:
        self.writer = writer
        self.last_write_seconds: float | None = None  # this rank's last committed save, snapshot to fsync

    @property
    def in_flight(self) -> bool:
        return self.writer.pending is not None

    def commit(self, *, wait: bool) -> str | None:
        """The tag committed now, or None (nothing in flight, or, without ``wait``, some rank still writing).
        Collective when a save is in flight (the same on every rank: saves start at the same iteration)."""
        pending = self.writer.pending
        if pending is None:
            return None
        if wait:
            pending.done.wait()
        if not all_ranks(pending.done.is_set()):
            return None
        self.writer.take()
        self.last_write_seconds = pending.write_seconds
        commit_save(pending.save_dir, pending.tag, pending.failure)
        return pending.tag


def async_checkpointer(environ=os.environ) -> AsyncCheckpointer:
    """--async-save's checkpointer (``TEST_SLOW_WRITE_ENV``: tests only, read here once)."""
    return AsyncCheckpointer(BackgroundWriter(delay_s=float(environ.get(TEST_SLOW_WRITE_ENV) or 0)))
