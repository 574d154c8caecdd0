"""Retention of old checkpoints in a ``--save`` directory, and the lock a reader holds on the tag it reads.

``--keep-last-n-checkpoints N`` keeps the N newest complete tags; ``--keep-every-n-iterations M`` also keeps, for
good, every tag whose iteration is a multiple of M. ``apply_retention`` runs on global rank 0 after each save is
committed (``latest`` names the new tag; the checkpoint manager, ``manager.py``, calls it) and removes the others,
under three rules:

* Only this run's tags (``run_dir.tag_owner``: holding nothing but the files a save writes, and recording this run's
  id and the iteration the tag's name says), only tags at or before the one ``latest`` names, only complete ones
  (``tag_is_complete``: every model file its metadata records and, when the optimizer state is ZeRO's, every ZeRO
  file), never the one ``latest`` names. Any other tag (a partial one from a crash mid-save, a copy, another run's,
  one with a user's file inside) is left as it is, said once, and does not count among the N.
* Never one a reader holds. The tools that read a checkpoint (conversion, generation, evaluation) hold a shared
  ``flock`` on the tag directory ``latest`` names while they read (``reading_checkpoint``); retention tries an
  exclusive one, non-blocking, and keeps a held tag and every later one (a reader reads ``latest`` more than once, so
  it may be reading any tag named after the one it holds) until a later save finds them free.
* Crash-safe: a tag is renamed to a hidden name of this run's (``.iter_0000100.deleting-<run id>``: nothing reads it
  as a checkpoint) under the exclusive lock, then removed; a removal cut short is finished by the next save's
  retention of the same run (a resume keeps the run id). Nothing else of that shape is touched.

A directory's ``flock`` needs no write access (a reader of a read-only copy can take it) and is dropped by the kernel
when its holder dies. It holds across nodes on Lustre mounted with ``-o flock`` and on GPFS; an NFS client sees only
its own node's directory locks: there, run the readers on rank 0's node, or keep enough checkpoints
(``--keep-last-n-checkpoints``) to outlast a read. Where a tag cannot be locked at all, retention keeps it (and warns).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterator, Sequence

from codegeex_train.checkpoint.deepspeed_files import check_model_files, check_zero_files, tag_files
from codegeex_train.checkpoint.files import META_KEY, TAG_PATTERN, read_latest, read_model_file
from codegeex_train.checkpoint.run_dir import tag_owner
from codegeex_train.checkpoint.safe_load import CheckpointError

logger = logging.getLogger(__name__)
_LOCK_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# Tries at reading `latest` and locking the tag it names: each failure means a save moved `latest` in between.
_READ_TRIES = 10


def tag_iteration(tag: str) -> int:
    """The iteration a tag names (``iter_0000100`` or DeepSpeed's ``global_step100``: 100)."""
    return int(re.search(r"[0-9]+$", tag).group())


def tag_is_complete(tag_dir: str | os.PathLike) -> bool:
    """Whether ``tag_dir`` holds every file of its save: one model file per model-parallel rank its metadata records
    (TP x PP) and, when the optimizer state is ZeRO's (DeepSpeed leaves the model file's ``optimizer`` empty then),
    one ZeRO file per (DP rank, model-parallel rank). Reads one pickle (model-parallel rank 0's file, mapped)."""
    try:
        files = tag_files(tag_dir)
        if 0 not in files.model:
            return False
        state = read_model_file(files.model[0])
        mp_size = state[META_KEY]["tp_size"] * state[META_KEY]["pp_size"]
        check_model_files(files, mp_size, "its metadata")
        dp_size = state.get("dp_world_size")
        if state.get("optimizer") is None and dp_size is not None:  # a training save with ZeRO's optimizer files
            check_zero_files(files, mp_size, int(dp_size))
    except Exception:  # noqa: BLE001 - whatever a damaged file raises (torch's unpickler: IndexError, EOFError, ...)
        return False  # not complete: kept
    return True


def tags_to_remove(tags: Sequence[str], latest: str, keep_last: int, keep_every: int | None,
                   removable: Callable[[str], bool]) -> list[str]:
    """Which of ``tags`` (in iteration order, none after ``latest``) retention removes, oldest first: the removable
    ones (``removable``: complete and this run's, asked only where it decides) that are neither among the
    ``keep_last`` newest removable tags (``latest`` the newest) nor at a multiple of ``keep_every``."""
    newest, remove = 0, []
    for tag in reversed(tags):
        if tag == latest:  # committed, so complete
            newest += 1
        elif newest < keep_last:
            newest += removable(tag)
        elif not (keep_every and tag_iteration(tag) % keep_every == 0) and removable(tag):
            remove.append(tag)
    return remove[::-1]


def _tags_up_to(save_dir: str, last: int) -> list[str]:
    """The tag directories (real ones, not links) of ``save_dir`` at iterations up to ``last``, in iteration order."""
    tags = []
    with os.scandir(save_dir) as entries:
        for entry in entries:
            if TAG_PATTERN.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False):
                if tag_iteration(entry.name) <= last:
                    tags.append(entry.name)
    return sorted(tags, key=lambda tag: (tag_iteration(tag), tag))


def _hidden_name(tag: str, run_id: str) -> str:
    """The name a tag of run ``run_id`` is renamed to for its removal."""
    return f".{tag}.deleting-{run_id}"


def _finish_removals(save_dir: str, run_id: str) -> None:
    """Remove what an interrupted retention of this run left renamed (its hidden ``.TAG.deleting-<run id>``)."""
    mine = re.compile(rf"\.({TAG_PATTERN.pattern})\.deleting-{re.escape(run_id)}")
    with os.scandir(save_dir) as entries:
        leftovers = [e.path for e in entries if mine.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]
    for path in leftovers:
        shutil.rmtree(path, ignore_errors=True)


def _lock_exclusive(tag_dir: str) -> int | None:
    """An open descriptor of ``tag_dir`` holding an exclusive flock, or None (said in one line) when a reader holds
    it or it cannot be locked."""
    try:
        fd = os.open(tag_dir, _LOCK_DIR)
    except OSError as e:
        logger.warning(f"retention: cannot open {tag_dir} to lock it ({e.strerror}): kept")
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            logger.info(f"retention: {tag_dir} is being read: it and later checkpoints are kept for now")
        else:
            logger.warning(f"retention: cannot lock {tag_dir} ({e.strerror}): it and later checkpoints are kept "
                           f"(a reader may be using them)")
        return None
    return fd


def apply_retention(save_dir: str, keep_last: int | None, keep_every: int | None = None, *,
                    run_id: str, foreign: set[str] | None = None) -> list[str]:
    """Remove the checkpoints of run ``run_id`` in ``save_dir`` that ``--keep-last-n-checkpoints keep_last`` and
    ``--keep-every-n-iterations keep_every`` let go (the module docstring's rules); returns the tags removed, oldest
    first. Nothing when ``keep_last`` is None. Global rank 0 only, after ``latest`` names the new save (it holds
    ``save_lock``'s lock: no other writer). A tag that cannot be removed is warned about, never raised; a tag that
    is not this run's is kept and said once (``foreign``: the tags already said, updated)."""
    if not keep_last:
        return []
    try:
        _finish_removals(save_dir, run_id)
        latest = read_latest(save_dir)
        tags = _tags_up_to(save_dir, tag_iteration(latest))
    except (CheckpointError, OSError) as e:
        logger.warning(f"retention: cannot list the checkpoints of {save_dir} ({e}): nothing removed")
        return []
    others = []

    def removable(tag: str) -> bool:  # asked only where it decides; a tag not this run's neither counts nor goes
        tag_dir = os.path.join(save_dir, tag)
        if tag_owner(tag_dir) != run_id:
            others.append(tag)
            return False
        return tag_is_complete(tag_dir)

    remove = tags_to_remove(tags, latest, keep_last, keep_every, removable)
    said = foreign if foreign is not None else set()
    new = [tag for tag in others if tag not in said]
    if new:
        logger.info(f"retention: keeps {', '.join(new)} in {save_dir}: not written by this run (another run's, a "
                    f"copy, a partial save, or holding other files); remove by hand if unwanted")
        said.update(new)
    removed = []
    for tag in tags[:tags.index(remove[-1]) + 1] if remove else ():
        tag_dir = os.path.join(save_dir, tag)
        fd = _lock_exclusive(tag_dir)
        if fd is None:  # a reader holds it: it may be reading any later tag too
            break
        hidden = os.path.join(save_dir, _hidden_name(tag, run_id))
        try:
            if tag not in remove:
                continue
            os.rename(tag_dir, hidden)
        except OSError as e:
            logger.warning(f"retention: cannot remove {tag_dir} ({e.strerror}): kept")
            continue
        finally:
            os.close(fd)
        shutil.rmtree(hidden, ignore_errors=True)  # hidden now: what is left is finished next time
        removed.append(tag)
    if removed:
        every = f" and every multiple of {keep_every}" if keep_every else ""
        logger.info(f"retention: removed {', '.join(removed)} from {save_dir} (keeping the last {keep_last}"
                    f"{every})")
    return removed


def _hold_latest(directory: str) -> tuple[int | None, str | None]:
    """(descriptor holding a shared flock on ``directory``'s latest tag, the tag), or (None, tag or None) when there
    is nothing to lock or it cannot be locked."""
    tag = None
    for _ in range(_READ_TRIES):
        try:
            tag = read_latest(directory)
        except CheckpointError:
            return None, None  # the reader's own checks say what is wrong
        path = os.path.join(directory, tag)
        try:
            fd = os.open(path, _LOCK_DIR)
        except OSError:
            continue  # removed since `latest` named it (a save moved it on), or not a directory: read it again
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            held, now = os.fstat(fd), os.stat(path, follow_symlinks=False)
        except OSError as e:
            os.close(fd)
            if e.errno == errno.ENOENT:
                continue
            logger.warning(f"cannot lock {path} ({e.strerror}): a run saving to {directory} with "
                           f"--keep-last-n-checkpoints could remove it while it is read")
            return None, tag
        if (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino):  # still the tag, not a directory renamed away
            return fd, tag
        os.close(fd)
    return None, tag  # `latest` names a tag that is not there: the reader's checks say so


@contextlib.contextmanager
def reading_checkpoint(directory: str | os.PathLike | None) -> Iterator[str | None]:
    """Hold the tag ``directory``'s ``latest`` names for the body (a shared flock on its directory): a run saving
    there with ``--keep-last-n-checkpoints`` keeps it, and every later tag, until the body is done. Yields the tag;
    None (and holds nothing) when ``directory`` is None or names no tag (the reader's own checks then say why)."""
    fd, tag = _hold_latest(str(directory)) if directory is not None else (None, None)
    try:
        yield tag
    finally:
        if fd is not None:
            os.close(fd)

