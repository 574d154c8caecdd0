"""Cache of derived index arrays (.npy) keyed by a hash of everything they were built from."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Callable

import numpy as np

__all__ = ["cache_key", "load_or_build"]


def cache_key(description: dict[str, Any]) -> str:
    """Short stable hash of a JSON-able description: change any input, get a new file name."""
    text = json.dumps(description, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _save_atomic(path: str, array: np.ndarray) -> None:
    # Ranks sharing a filesystem may build the same file at once; each writes its own tmp file
    # and renames, so readers never see a partial file and the (identical) winner is kept.
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            np.save(f, array)
        os.replace(tmp, path)
    except OSError:  # a full disk: leave no partial tmp file behind
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def load_or_build(
    stem: str, names: tuple[str, ...], build: Callable[[], tuple[np.ndarray, ...]], best_effort: bool = False
) -> tuple[tuple[np.ndarray, ...], bool]:
    """Arrays ``{stem}_{name}.npy`` (memory-mapped) and whether they came from the cache.

    On a miss (any file absent, e.g. after a crash mid-write) ``build()`` runs and every array
    is written again. ``best_effort``: the cache only saves time (nothing else reads the files), so an
    unreadable file is a miss and a directory that cannot be written (read-only data) is no error.
    """
    paths = [f"{stem}_{name}.npy" for name in names]
    if all(os.path.isfile(p) for p in paths):
        try:
            return tuple(np.load(p, mmap_mode="r") for p in paths), True
        except (OSError, ValueError):
            if not best_effort:
                raise
    arrays = build()
    if len(arrays) != len(names):
        raise ValueError(f"build() returned {len(arrays)} arrays for names {names}")
    try:
        os.makedirs(os.path.dirname(os.path.abspath(stem)), exist_ok=True)
        for path, array in zip(paths, arrays):
            _save_atomic(path, array)
    except OSError:
        if not best_effort:
            raise
    return arrays, False
