"""One writer per ``--save`` directory: ``DIR/.lock``, held by the job's global rank 0 for the run's life.

Two runs on one directory would interleave ``latest`` (each names its own tags) and overwrite each other's tags.
``hold_save_dir`` takes an exclusive kernel lock on ``DIR/.lock`` (POSIX ``lockf``, non-blocking) before any
process group exists, and writes the holder into the file (host, pid, start time); a second run is refused with one
line naming the directory and that holder. The kernel drops the lock when the holding process ends, however it ends
(kill -9 included): nothing stale is left behind, and no heartbeat is needed.

Why ``lockf`` (``fcntl`` record locks) and not ``flock``: record locks belong to the process, so forked children
(DataLoader workers) do not inherit them and cannot keep a dead run's lock alive; and they are the locks that
network file systems carry between nodes: NFS through NLM (v3) or its own protocol (v4; a dead node's locks go when
its lease expires, 90 s by default), Lustre when mounted with ``-o flock`` (``localflock`` or no option: the lock is
seen on one node only, or refused), GPFS natively. Where the file system has no locks at all, the run starts with a
warning that two runs on the directory would not be stopped. (The one caveat of record locks: a process loses them
when it closes *any* descriptor of the file, so nothing else in the holder opens ``DIR/.lock``.)

Only global rank 0 takes it (it writes ``latest``; every other rank of the job learns of a refusal when rank 0 exits
and the launcher ends the job). A dry run takes none.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import logging
import os
import socket

logger = logging.getLogger(__name__)

LOCK_NAME = ".lock"
_HELD = (errno.EACCES, errno.EAGAIN)  # what lockf says when another process holds the lock


class SaveLockError(RuntimeError):
    """The ``--save`` directory's lock is held by another live run, or its lock file cannot be opened."""


class SaveLock:
    """An open ``DIR/.lock`` whose record lock this process holds; ``release()`` (or the process ending) drops it."""

    def __init__(self, save_dir: str, fd: int | None):
        self.save_dir, self._fd = save_dir, fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "SaveLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self):
        self.release()


def holder_line() -> str:
    """What the lock file records of this process: host, pid and start time."""
    now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    return f"host {socket.gethostname()}, pid {os.getpid()}, started {now}\n"


def _read_holder(path: str) -> str:
    """The holder a lock file records, one line (never more than a line's worth of it)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            text = os.read(fd, 200).decode("utf-8", errors="replace")
        finally:
            os.close(fd)
    except OSError:
        text = ""
    line = text.splitlines()[0].strip() if text.strip() else ""
    return line or "holder not recorded yet"


def hold_save_dir(save_dir: str) -> SaveLock:
    """Take ``save_dir``'s lock for this process (creating the directory when missing); :class:`SaveLockError` when
    another live process holds it. A file system without locks gives an unheld SaveLock and one warning."""
    os.makedirs(save_dir, exist_ok=True)
    path = os.path.join(save_dir, LOCK_NAME)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise SaveLockError(f"--save {save_dir}: cannot open its lock file {path} ({e.strerror}); it keeps a second "
                           f"run off the directory: make it a regular file this user can write, or remove it") from None
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in _HELD:
            raise SaveLockError(
                f"--save {save_dir} is in use by another run ({_read_holder(path)}; it holds {path}): two runs on "
                f"one directory would interleave 'latest'. Stop that run, or give this one another --save") from None
        logger.warning(f"--save {save_dir}: this file system cannot lock {path} ({e.strerror}): a second run on the "
                       f"directory would not be stopped (Lustre: mount with -o flock)")
        return SaveLock(save_dir, None)
    line = holder_line().encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, line, 0)  # through the locked descriptor: another open and close would drop the lock
    return SaveLock(save_dir, fd)
