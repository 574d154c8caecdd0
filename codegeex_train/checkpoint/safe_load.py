"""Refuse a checkpoint file whose pickle would run code, before anything unpickles it for real.

``torch.load(weights_only=False)`` (plain ``pickle``) calls whatever callables a file names: a ``__reduce__``
returning ``(os.system, ...)`` or ``(pathlib.Path.touch, ...)`` runs on load. So every ``.pt`` file we read
goes through :func:`safe_torch_load`, ``torch.load(weights_only=True)``: torch's restricted unpickler rebuilds
tensors, storages, dicts, lists, tuples, sets, numbers, strings, ``None``, dtypes, devices and a few more
torch types, plus the classes of ``ALLOWED`` below, and stops at any other global before calling it. A
refused or unreadable file raises :class:`CheckpointError` (:class:`UnsafeCheckpointError` when refused)
with a one-line message naming the file.

:func:`verify_checkpoint_dir` applies that check to every ``.pt`` file under a checkpoint tag before
DeepSpeed's ``engine.load_checkpoint``, which then unpickles its own files (the model states and the ZeRO
optimizer partitions) again with ``weights_only=False``: the check is what stands between a tampered file
and that load (the files must not change in between).

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
import importlib
import os
import pickle
import re
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


def _is_zip(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"PK\x03\x04"


def _globals_outside_defaults(path: Path) -> list[str] | None:
    """The pickle's globals that torch's weights-only defaults lack, by a static scan (nothing is run);
    None when the scan cannot tell (older torch, legacy format, unparsable pickle)."""
    scan = getattr(torch.serialization, "get_unsafe_globals_in_checkpoint", None)
    if scan is None:
        return None
    try:
        return sorted(scan(str(path)))
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


def safe_torch_load(path: str | os.PathLike, *, mmap: bool = False) -> object:
    """``torch.load(path, map_location="cpu", weights_only=True)`` with ``ALLOWED`` allow-listed.

    ``mmap=True`` maps the tensors' bytes instead of reading them (zip-format files; others are read): the
    cheap way to check a file or read its metadata. Raises :class:`UnsafeCheckpointError` when the pickle
    needs anything else (nothing in it is run), :class:`CheckpointError` when the file cannot be read.
    """
    path = Path(path)
    try:
        is_zip = _is_zip(path)
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint file {path}: {_one_line(e.strerror or str(e))}") from None
    extra = _globals_outside_defaults(path) if is_zip else None
    names = list(ALLOWED) if extra is None else [n for n in ALLOWED if n in extra]
    try:
        allowed = [_resolve(n) for n in names]
    except (ImportError, AttributeError) as e:  # DeepSpeed missing or changed: refuse rather than guess
        raise UnsafeCheckpointError(f"refusing checkpoint file {path}: cannot import its allow-listed types "
                                    f"{names}: {_one_line(str(e))}") from None
    try:
        with _allowing(allowed):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap and is_zip)
    except pickle.UnpicklingError as e:
        outside = [n for n in extra or () if n not in ALLOWED]
        what = f"needs {', '.join(outside)}" if outside else f"failed weights-only unpickling: {_refusal(e)}"
        raise UnsafeCheckpointError(
            f"refusing checkpoint file {path}: its pickle {what}; only tensors, plain data and the types in "
            f"codegeex_train/checkpoint/safe_load.py ALLOWED may be loaded, so nothing in it was run (altered, or not "
            f"written by codegeex_train / DeepSpeed?)") from None
    except _LOAD_ERRORS as e:
        reason = _one_line(str(e).split(". This is an internal")[0]) or type(e).__name__
        raise CheckpointError(f"cannot read checkpoint file {path}: {reason}") from None


def verify_files(paths: Iterable[str | os.PathLike]) -> None:
    """:func:`safe_torch_load` (mapped, so cheap) every file of ``paths``; raises on the first refusal."""
    for path in paths:
        safe_torch_load(path, mmap=True)


def checkpoint_files(tag_dir: str | os.PathLike) -> list[Path]:
    """Every ``*.pt`` file under ``tag_dir``, recursively (linked directories followed once), sorted."""
    found, seen = [], set()
    for root, dirs, files in os.walk(tag_dir, followlinks=True):
        real = os.path.realpath(root)
        if real in seen:
            dirs[:] = []
            continue
        seen.add(real)
        dirs.sort()
        found.extend(Path(root, f) for f in sorted(files) if f.endswith(CHECKED_SUFFIX))
    return found


def verify_checkpoint_dir(directory: str | os.PathLike, tag: str) -> list[Path]:
    """Check every ``.pt`` file of checkpoint ``directory/tag`` with weights-only unpickling before anything
    else (DeepSpeed's loaders) unpickles it; returns the files checked."""
    tag_dir = Path(directory) / tag
    if not tag_dir.is_dir():
        raise CheckpointError(f"{directory}/latest names tag {tag!r} but {tag_dir} is not a directory")
    files = checkpoint_files(tag_dir)
    verify_files(files)
    return files
