"""Refuse a checkpoint file whose pickle would run code, before anything unpickles it for real.

``torch.load(weights_only=False)`` (plain ``pickle``) calls whatever callables a file names: a ``__reduce__``
returning ``(os.system, ...)`` or ``(pathlib.Path.touch, ...)`` runs on load. So every ``.pt`` file we read
goes through :func:`safe_torch_load`, ``torch.load(weights_only=True)``: torch's restricted unpickler rebuilds
tensors, storages, dicts, lists, tuples, sets, numbers, strings, ``None``, dtypes, devices and a few more
torch types, plus the classes of ``ALLOWED`` below, and stops at any other global before calling it. A
refused or unreadable file raises :class:`CheckpointError` (:class:`UnsafeCheckpointError` when refused)
with a one-line message naming the file.

:func:`verify_checkpoint_dir` applies that check to every ``.pt`` file under a checkpoint tag before
DeepSpeed's ``engine.load_checkpoint`` (one ``error:`` line before any process group). DeepSpeed then reads its
own files (the model states and the ZeRO optimizer partitions) again, through the checkpoint engine
``checkpoint/deepspeed_checkpoint.py`` installs, whose ``load`` is :func:`safe_torch_load` too: a file changed after the check
is refused there, never unpickled with ``weights_only=False``.

Files are opened once, without blocking, and must be regular files (a FIFO or device named ``*.pt`` is refused,
never read); the check reads the descriptor it opened (``/proc/self/fd/N``), so a path swapped after the open
changes nothing. :func:`checkpoint_files` lists a tag directory without following symbolic links, and refuses a
``*.pt`` entry that is a link or not a regular file.

torch itself must be one without known bypasses of ``weights_only=True`` (``MIN_TORCH``): CVE-2025-32434
(GHSA-53q9-r3pm-6pq6, torch <= 2.5.1, fixed in 2.6.0) and CVE-2026-24747 (GHSA-63cw-57p8-fm3p: memory corruption
by crafted pickle opcodes and storage sizes, torch <= 2.9.1, fixed in 2.10.0). On an older torch every read is
refused with one line saying so (``setup.py`` requires the same floor).

``ALLOWED``: exactly the non-default globals that files we and DeepSpeed (ZeRO 1/2, fp32 / bf16 / fp16) write
hold, found by saving real checkpoints and listing their pickles' globals:

* ``deepspeed.runtime.fp16.loss_scaler.LossScaler`` -- the ZeRO optimizer's state dict stores its loss
  scaler object (``loss_scaler``): this static one (scale 1.0) in fp32 and bf16 runs;
* ``deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler`` -- the same entry under fp16 with dynamic loss
  scaling (floats, ints, bools and a ``torch.dtype``);
* ``deepspeed.runtime.zero.config.ZeroStageEnum`` -- the ``zero_stage`` entry, an ``int`` Enum;
* ``deepspeed.utils.tensor_fragment.fragment_address`` -- ``param_slice_mappings``: where each parameter's
  fragment lies in the rank's flat partition, a dataclass of two ints;
* ``torch.Size`` (``param_shapes``) and ``collections.OrderedDict`` (state dicts) -- torch's own defaults
  already; listed so that older torch versions accept them too.

All are classes; the restricted unpickler builds them with ``cls.__new__`` and a ``__dict__`` update (none
defines ``__setstate__``), or calls the Enum with its int value, so no code of the file's choosing runs. No
function is allow-listed. Our own metadata (``codegeex_train`` in the model files: the model config, sizes,
iteration, training state with RNG states as tensors) is plain data and needs none of them. The DeepSpeed
classes are imported only when a file names them, so reading our model files does not import DeepSpeed.
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import os
import pickle
import re
import stat
from collections.abc import Iterable
from pathlib import Path

import torch

ALLOWED = (
    "collections.OrderedDict",
    "torch.Size",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)
# The files DeepSpeed's checkpoint loaders unpickle (model states, ZeRO partitions, universal fragments) all
# end in ".pt"; we check every such file under the tag.
CHECKED_SUFFIX = ".pt"
# The oldest torch without known weights_only bypasses (see the module docstring); setup.py requires it too.
MIN_TORCH = (2, 10)
# What torch.load of a file from outside raises when the file is refused, corrupt, truncated or unreadable.
_LOAD_ERRORS = (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError, TypeError)


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, unreadable, refused or does not fit this run; the message (one line)
    names the file or both sides. ``codegeex_train.checkpoint.files`` re-exports it."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file whose pickle needs more than tensors, plain data and ``ALLOWED``."""


def _resolve(name: str) -> type:
    module, _, attr = name.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def check_torch_version() -> None:
    """Raise :class:`UnsafeCheckpointError` when this torch has known bypasses of ``weights_only=True``."""
    version = torch.torch_version.TorchVersion(torch.__version__)
    if version < MIN_TORCH:
        raise UnsafeCheckpointError(
            f"torch {torch.__version__} has known bypasses of weights-only loading (CVE-2025-32434, fixed in 2.6.0; "
            f"CVE-2026-24747, fixed in 2.10.0), so no checkpoint file is read with it: install torch >= "
            f"{'.'.join(map(str, MIN_TORCH))}")


def file_kind(mode: int) -> str:
    """'a directory', 'a FIFO', ... for a non-regular file's ``st_mode``."""
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str | os.PathLike, *, follow_symlinks: bool = True) -> int:
    """A read-only descriptor of ``path``, which must be a regular file: opened without blocking (a FIFO's open
    would wait for a writer), then checked with ``fstat``, so what is checked is what was opened. Raises
    :class:`CheckpointError` naming the file otherwise."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    if not follow_symlinks:
        flags |= os.O_NOFOLLOW
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if not follow_symlinks and os.path.islink(path):
            raise CheckpointError(f"{path} is a symbolic link, not a file of its own") from None
        raise CheckpointError(f"cannot read checkpoint file {path}: {_one_line(e.strerror or str(e))}") from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise CheckpointError(f"cannot read checkpoint file {path}: {os.strerror(errno.EISDIR)}")
        if not stat.S_ISREG(mode):
            raise CheckpointError(f"cannot read checkpoint file {path}: it is {file_kind(mode)}, not a regular file "
                                  f"(nothing read from it)")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _fd_path(fd: int, path: Path) -> str:
    """A name that opens the file of descriptor ``fd`` (Linux: /proc/self/fd/N), else ``path``."""
    name = f"/proc/self/fd/{fd}"
    return name if os.path.exists(name) else str(path)


def _globals_outside_defaults(path: str) -> list[str] | None:
    """The pickle's globals that torch's weights-only defaults lack, by a static scan (nothing is run);
    None when the scan cannot tell (older torch, legacy format, unparsable pickle)."""
    scan = getattr(torch.serialization, "get_unsafe_globals_in_checkpoint", None)
    if scan is None:
        return None
    try:
        return sorted(scan(path))
    except _LOAD_ERRORS + (AssertionError, KeyError, IndexError):
        return None


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _refusal(error: BaseException) -> str:
    """torch's weights-only error, without its advice to allow-list the global or to drop weights_only."""
    text = str(error)
    match = re.search(r"WeightsUnpickler error:\s*(.+)", text, re.S)
    reason = (match.group(1) if match else text).strip().split("\n")[0]
    return _one_line(re.split(r"\.? Please use", reason)[0]) or type(error).__name__


def _allowing(classes: list[type]):
    """torch's ``safe_globals`` context (torch >= 2.5); on older torch, the process-wide allow-list."""
    context = getattr(torch.serialization, "safe_globals", None)
    if context is not None:
        return context(classes)
    torch.serialization.add_safe_globals(classes)
    return contextlib.nullcontext()


def safe_torch_load(path: str | os.PathLike, *, mmap: bool = False, map_location=None) -> object:
    """``torch.load(path, map_location=map_location or "cpu", weights_only=True)`` with ``ALLOWED`` allow-listed.

    ``mmap=True`` maps the tensors' bytes instead of reading them (zip-format files; others are read): the
    cheap way to check a file or read its metadata. Raises :class:`UnsafeCheckpointError` when the pickle
    needs anything else (nothing in it is run) or this torch is too old (``MIN_TORCH``), :class:`CheckpointError`
    when the file cannot be read or is not a regular file.
    """
    path = Path(path)
    check_torch_version()
    fd = open_regular(path)
    try:
        return _load_open_file(path, fd, mmap, "cpu" if map_location is None else map_location)
    finally:
        os.close(fd)


def _load_open_file(path: Path, fd: int, mmap: bool, map_location) -> object:
    try:
        is_zip = os.pread(fd, 4, 0) == b"PK\x03\x04"
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint file {path}: {_one_line(e.strerror or str(e))}") from None
    name = _fd_path(fd, path)  # the file opened and checked above, whatever its path names by now
    extra = _globals_outside_defaults(name) if is_zip else None
    names = list(ALLOWED) if extra is None else [n for n in ALLOWED if n in extra]
    try:
        allowed = [_resolve(n) for n in names]
    except (ImportError, AttributeError) as e:  # DeepSpeed missing or changed: refuse rather than guess
        raise UnsafeCheckpointError(f"refusing checkpoint file {path}: cannot import its allow-listed types "
                                    f"{names}: {_one_line(str(e))}") from None
    try:
        with _allowing(allowed):
            if name == str(path):  # no /proc: read from the descriptor (a file object; no mapping)
                with os.fdopen(os.dup(fd), "rb") as f:
                    return torch.load(f, map_location=map_location, weights_only=True)
            return torch.load(name, map_location=map_location, weights_only=True, mmap=mmap and is_zip)
    except pickle.UnpicklingError as e:
        outside = [n for n in extra or () if n not in ALLOWED]
        what = f"needs {', '.join(outside)}" if outside else f"failed weights-only unpickling: {_refusal(e)}"
        raise UnsafeCheckpointError(
            f"refusing checkpoint file {path}: its pickle {what}; only tensors, plain data and the types in "
            f"codegeex_train/checkpoint/safe_load.py ALLOWED may be loaded, so nothing in it was run (altered, or not "
            f"written by codegeex_train / DeepSpeed?)") from None
    except _LOAD_ERRORS as e:
        reason = _one_line(str(e).split(". This is an internal")[0].replace(name, str(path))) or type(e).__name__
        raise CheckpointError(f"cannot read checkpoint file {path}: {reason}") from None


def verify_files(paths: Iterable[str | os.PathLike]) -> None:
    """:func:`safe_torch_load` (mapped, so cheap) every file of ``paths``; raises on the first refusal."""
    for path in paths:
        safe_torch_load(path, mmap=True)


def checkpoint_files(tag_dir: str | os.PathLike) -> list[Path]:
    """Every ``*.pt`` file under ``tag_dir``, recursively, sorted. Nothing is followed: a symbolic link (to a file
    or a directory) or a FIFO, socket or device named ``*.pt`` raises :class:`CheckpointError`; other links are
    skipped (DeepSpeed writes none). Only names and ``lstat`` are read, so nothing here blocks."""
    found = []
    pending = [Path(tag_dir)]
    while pending:
        directory = pending.pop()
        try:
            entries = sorted(os.scandir(directory), key=lambda e: e.name)
        except OSError as e:
            raise CheckpointError(f"cannot list {directory}: {_one_line(e.strerror or str(e))}") from None
        for entry in entries:
            path = Path(entry.path)
            if entry.is_dir(follow_symlinks=False):
                pending.append(path)
            elif entry.name.endswith(CHECKED_SUFFIX):
                mode = entry.stat(follow_symlinks=False).st_mode
                if not stat.S_ISREG(mode):
                    raise CheckpointError(f"{path} is {file_kind(mode)}, not a regular file: a checkpoint file is "
                                          f"read only from a regular file inside the tag directory")
                found.append(path)
    return sorted(found)


def check_tag_dir(directory: str | os.PathLike, tag: str) -> Path:
    """``directory/tag``, which must be a directory of its own (not a symbolic link), without reading it."""
    tag_dir = Path(directory) / tag
    try:
        mode = os.lstat(tag_dir).st_mode
    except OSError:
        raise CheckpointError(f"{directory}/latest names tag {tag!r} but {tag_dir} does not exist") from None
    if not stat.S_ISDIR(mode):
        raise CheckpointError(f"{directory}/latest names tag {tag!r} but {tag_dir} is {file_kind(mode)}, not a "
                              f"directory (a tag directory is never followed through a link)")
    return tag_dir


def verify_checkpoint_dir(directory: str | os.PathLike, tag: str) -> list[Path]:
    """Check every ``.pt`` file of checkpoint ``directory/tag`` with weights-only unpickling before anything
    else (DeepSpeed's loaders) unpickles it; returns the files checked."""
    files = checkpoint_files(check_tag_dir(directory, tag))
    verify_files(files)
    return files
