"""A ``--save`` directory belongs to one run: what it holds, who wrote each tag, and moving a run aside.

Every training checkpoint records the id of the run that wrote it (``TrainState.run_id``: new for each run
started, kept by every resume). From that:

* **A relaunch resumes.** A ``--save`` whose ``latest`` names a checkpoint holds a run; pretrain resumes it when no
  ``--load`` is given (or ``--load`` names the same run), and refuses any other start there (``resume.preflight_load``)
  unless ``--start-over`` says to start a new run: then ``archive_run`` first moves the old run into
  ``<save>/previous-runs/N/`` (a directory ``--load`` can resume), deleting and overwriting nothing.
* **A save never writes over what this run did not write.** A tag directory that already exists where a save is
  about to write, and is not this run's (``tag_owner``), is moved aside (``set_aside``) into its own
  ``previous-runs/N/`` first: a user's copy, a foreign run's tag, or a partial save of unknown origin.
* **Retention removes only this run's tags** (``retention.py`` asks ``tag_owner``): complete, holding nothing but
  the files a save writes, recording this run's id and the iteration its name says.

Moves are renames inside ``--save`` (one file system), ordered so that a crash at any point loses nothing: a run's
other entries first, then ``latest``, then the tag it names (until ``latest`` is gone the run still resumes from
where it was; after, its tag is found in the archive or, if the crash came between the two, left where it was and
moved aside by the first save that would write over it).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from codegeex_train.checkpoint.deepspeed_files import MODEL_FILE, ZERO_FILE
from codegeex_train.checkpoint.files import META_KEY, TAG_PATTERN, checkpoint_tag, read_latest, read_model_file
from codegeex_train.checkpoint.safe_load import CheckpointError
from codegeex_train.checkpoint.save_lock import LOCK_NAME, hold_save_dir

logger = logging.getLogger(__name__)

ARCHIVE_DIR = "previous-runs"
# The tag of the checkpoint a stop by signal saved (the run's last), written after `latest` (``write_preempted_marker``).
PREEMPTED_MARKER = "preempted"
# What a run writes into --save beside its tags and `latest` (moved with them by --start-over); logs/, profiles,
# TensorBoard and wandb directories stay where they are.
RUN_FILES = ("config.yaml", "metrics.jsonl", PREEMPTED_MARKER)
# DeepSpeed's copy of its recovery script, written into every tag beside the model and ZeRO files.
_SCRIPT = "zero_to_fp32.py"


def holds_run(save_dir: str | os.PathLike) -> bool:
    """Whether ``save_dir`` holds a run: a ``latest`` (whatever it is: a damaged one is for the resume to report)."""
    return os.path.lexists(os.path.join(save_dir, "latest"))


def recorded_run_id(directory: str | os.PathLike) -> str | None:
    """The run id the checkpoint ``directory``'s ``latest`` names records (a training or universal checkpoint);
    None when it records none or cannot be read (the resume's own checks say why)."""
    from codegeex_train.checkpoint.universal import is_universal, read_universal_meta

    try:
        tag = read_latest(directory)
        if is_universal(directory, tag):
            state = read_universal_meta(directory, tag).get("train_state", {})
        else:
            state = read_model_file(Path(directory) / tag / "mp_rank_00_model_states.pt")[META_KEY].get(
                "train_state", {})
    except (CheckpointError, OSError, KeyError, TypeError):
        return None
    run_id = state.get("run_id") if isinstance(state, dict) else None
    return run_id if isinstance(run_id, str) else None


def _only_save_files(tag_dir: Path) -> bool:
    """Whether ``tag_dir`` holds nothing but regular files a save writes (model files, ZeRO files, the script)."""
    with os.scandir(tag_dir) as entries:
        return all(entry.is_file(follow_symlinks=False)
                   and (MODEL_FILE.match(entry.name) or ZERO_FILE.match(entry.name) or entry.name == _SCRIPT)
                   for entry in entries)


def tag_owner(tag_dir: str | os.PathLike) -> str | None:
    """The run that wrote the tag directory ``tag_dir``: the run id its model file records, when the directory holds
    only the files a save writes and that file records the iteration the directory's name says; else None (a user's
    file inside, a tag renamed or copied over another, a partial save without its first model file, a checkpoint
    saved before run ids were recorded)."""
    tag_dir = Path(tag_dir)
    try:
        if not TAG_PATTERN.fullmatch(tag_dir.name) or not _only_save_files(tag_dir):
            return None
        meta = read_model_file(tag_dir / "mp_rank_00_model_states.pt")[META_KEY]
        state = meta["train_state"]
        if tag_dir.name != checkpoint_tag(meta["iteration"]) or state["iteration"] != meta["iteration"]:
            return None
        run_id = state.get("run_id")
    except Exception:  # noqa: BLE001 - whatever a damaged or foreign file raises: not provably this run's
        return None
    return run_id if isinstance(run_id, str) else None


def _new_archive(save_dir: Path) -> Path:
    """A new, empty ``save_dir/previous-runs/N`` (N one above the highest there)."""
    root = save_dir / ARCHIVE_DIR
    root.mkdir(exist_ok=True)
    taken = [int(p.name) for p in root.iterdir() if p.name.isdigit()]
    number = max(taken, default=0) + 1
    while True:
        try:
            (root / str(number)).mkdir()
            return root / str(number)
        except FileExistsError:  # (only a concurrent mover could take it: the save lock excludes one)
            number += 1


def archive_run(save_dir: str | os.PathLike) -> Path | None:
    """Move the run ``save_dir`` holds (its tags, ``latest`` and ``RUN_FILES``) into a new
    ``save_dir/previous-runs/N/``, in the crash-safe order of the module docstring; returns it (None: nothing to
    move). Global rank 0, under the save lock, before anything of the new run is written."""
    save_dir = Path(save_dir)
    try:
        latest_tag = read_latest(save_dir) if holds_run(save_dir) else None
    except CheckpointError:
        latest_tag = None  # a damaged `latest`: moved with the rest, never read
    with os.scandir(save_dir) as entries:
        tags = [e.name for e in entries if TAG_PATTERN.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]
    others = [name for name in (*sorted(t for t in tags if t != latest_tag), *RUN_FILES)
              if os.path.lexists(save_dir / name)]
    last = [name for name in ("latest", latest_tag) if name and os.path.lexists(save_dir / name)]
    if not others and not last:
        return None
    archive = _new_archive(save_dir)
    for name in (*others, *last):
        os.rename(save_dir / name, archive / name)
    return archive


def set_aside(save_dir: str | os.PathLike, tag: str) -> Path:
    """Move ``save_dir/tag`` (not this run's, where a save is about to write) into a new
    ``save_dir/previous-runs/N/``; returns its new path."""
    archive = _new_archive(Path(save_dir))
    os.rename(Path(save_dir) / tag, archive / tag)
    return archive / tag


def clear_tag_for(save_dir: str | os.PathLike, tag: str, run_id: str) -> None:
    """Before run ``run_id`` writes ``save_dir/tag``: a directory there that another run (or anyone) left is moved
    aside, said in one line. Its own earlier partial write of the tag stays to be written over. Global rank 0."""
    path = Path(save_dir) / tag
    if not os.path.lexists(path) or tag_owner(path) == run_id:
        return
    moved = set_aside(save_dir, tag)
    logger.warning(f"{path} was already there and not written by this run: moved to {moved} (nothing deleted) "
                   f"before saving {tag}")


@contextlib.contextmanager
def new_checkpoint_dir(directory: str | os.PathLike, flag: str) -> Iterator[None]:
    """For a tool that writes a new checkpoint (and its ``latest``) into ``directory`` (``flag``: the option naming
    it), held for the body: the directory's save lock, so that no run or other tool writes there meanwhile, and a
    refusal when it already holds a run, whose ``latest`` the new checkpoint would replace (a relaunch of that run
    would then resume from it and overwrite the run). Raises SaveLockError or CheckpointError, one line each. A body
    that fails leaves no lock file it created (nor the directory, if it created that and nothing else is in it)."""
    created, lock_file = not os.path.lexists(directory), os.path.join(directory, LOCK_NAME)
    made_lock_file = not os.path.lexists(lock_file)
    lock = hold_save_dir(str(directory))
    try:
        if holds_run(directory):
            raise CheckpointError(f"{flag} {directory} holds a run ('latest' names {_readable_latest(directory)}): "
                                  f"writing a checkpoint there would replace its 'latest', and a relaunch of that run "
                                  f"would resume from it and overwrite the run; write into a new, empty directory")
        yield
    except BaseException:
        with contextlib.suppress(OSError):
            if made_lock_file:
                os.unlink(lock_file)
            if created:
                os.rmdir(directory)
        raise
    finally:
        lock.release()


def write_preempted_marker(save_dir: str | os.PathLike, tag: str) -> None:
    """``<save_dir>/preempted`` := ``tag``, atomically (after ``latest`` names ``tag``): the launchers report a job
    stopped by a signal as failed, so a wrapper reads this instead (docs/clusters-preemption.md). Global rank 0."""
    tmp = Path(save_dir) / f"{PREEMPTED_MARKER}.tmp"
    tmp.write_text(tag)
    os.replace(tmp, Path(save_dir) / PREEMPTED_MARKER)


def clear_preempted_marker(save_dir: str | os.PathLike) -> None:
    """A run that goes on from a stop by signal removes its marker: it names the current ``latest`` only while the run
    stands at that stop. Global rank 0."""
    Path(save_dir, PREEMPTED_MARKER).unlink(missing_ok=True)


def _readable_latest(directory) -> str:
    try:
        return read_latest(directory)
    except CheckpointError:
        return "no readable tag"
