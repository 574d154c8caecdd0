"""Every token id inside the model's vocabulary: checked once per dataset at start-up, and on every sample.

The vocab-parallel embedding and loss mask ids outside a rank's shard, so at TP >= 2 an id outside the whole
vocabulary (negative, or >= the padded size) would train silently on zeros; at TP 1 it is an IndexError mid-run.

* ``check_token_ids``: the dataset's id range (one chunked min/max pass over the memory-mapped .bin, cached
  beside the index under a key of both files' size, mtime and inode, so a rebuilt dataset is scanned again; a cache
  that cannot be written costs a rescan, never the run). A bad range is located (first offending token) and
  refused with the document and the id.
* ``in_vocab`` on every sample the GPT dataset reads (one argmax, ~2 us here), and ``refuse_sample`` naming the
  document of a bad one: for data that changed after the start-up check.
"""

from __future__ import annotations

import os
from typing import NoReturn

import numpy as np

from codegeex_train.data.indexed_dataset import MMapIndexedDataset, bin_path, idx_path
from codegeex_train.data.npy_cache import cache_key, load_or_build

__all__ = ["TokenIdError", "check_token_ids", "in_vocab", "refuse_sample", "scan_token_range", "token_range"]

# Ids per numpy step: 256K was the fastest chunk here (it stays in cache between the min and the max).
CHUNK_TOKENS = 1 << 18
_FORMAT = 1  # bump when the scan changes, to invalidate caches


class TokenIdError(ValueError):
    """A token id outside the vocabulary; the message names the file, the document and the id."""

    def one_line(self) -> str:
        """The message alone: a DataLoader worker's error comes back wrapped with the worker's traceback."""
        text = str(self).rstrip()
        marker = f"{type(self).__name__}: "
        return text[text.rindex(marker) + len(marker):] if "Original Traceback" in text and marker in text else text


def in_vocab(ids: np.ndarray, vocab_size: int) -> bool:
    """Every id in [0, vocab_size) (NaN in a float dataset is outside)."""
    if ids.size == 0:
        return True
    kind = ids.dtype.kind
    if kind == "i" and vocab_size <= 1 << (8 * ids.dtype.itemsize - 1):
        ids, kind = ids.view(f"u{ids.dtype.itemsize}"), "u"  # a negative id reads as >= 2^(bits - 1): one pass
    # argmax/argmin, not max/min: they skip numpy's Python-level reduction wrapper (~1 us instead of ~4 on a sample).
    return (kind == "u" or ids.item(ids.argmin()) >= 0) and ids.item(ids.argmax()) < vocab_size


def scan_token_range(tokens: np.ndarray) -> np.ndarray:
    """[min, max] of a non-empty token array, chunk by chunk (in its own dtype)."""
    lo, hi = tokens[0], tokens[0]
    for start in range(0, tokens.size, CHUNK_TOKENS):
        chunk = tokens[start:start + CHUNK_TOKENS]
        lo, hi = np.minimum(lo, chunk.min()), np.maximum(hi, chunk.max())
    return np.array([lo, hi], dtype=tokens.dtype)


def token_range(ds: MMapIndexedDataset) -> np.ndarray | None:
    """[min, max] of every id of ``ds`` (None when empty), cached beside its index."""
    if ds.num_tokens == 0:
        return None
    files = [bin_path(ds.prefix), idx_path(ds.prefix)]
    stats = [(st.st_size, st.st_mtime_ns, st.st_ino) for st in map(os.stat, files)]
    key = cache_key({"format": _FORMAT, "prefix": os.path.abspath(ds.prefix), "dtype": ds.dtype.str, "files": stats})
    stem = os.path.join(os.path.dirname(os.path.abspath(ds.prefix)), f"{os.path.basename(ds.prefix)}_ids_{key}")
    (ids,), _ = load_or_build(stem, ("range",), lambda: (scan_token_range(ds.tokens),), best_effort=True)
    if ids.shape != (2,) or ids.dtype != ds.dtype:  # a stray file under the cache's name
        ids = scan_token_range(ds.tokens)
    return ids


def _first_bad(tokens: np.ndarray, vocab_size: int) -> int | None:
    for start in range(0, tokens.size, CHUNK_TOKENS):
        chunk = tokens[start:start + CHUNK_TOKENS]
        bad = ~((chunk >= 0) & (chunk < vocab_size))
        if bad.any():
            return start + int(bad.argmax())
    return None


def _describe(value, document: int, offset: int, path: str, vocab_size: int) -> str:
    what = ("negative" if value < 0 else f"beyond the vocabulary ({vocab_size} ids)"
            if value >= vocab_size else "not a token id")
    return f"token id {value.item()} at position {offset} of document {document} in {path} is {what}"


def check_token_ids(ds: MMapIndexedDataset, vocab_size: int) -> None:
    """Refuse a dataset holding any id outside [0, vocab_size), naming the first one."""
    ids = token_range(ds)
    if ids is None or in_vocab(ids, vocab_size):
        return
    position = _first_bad(ds.tokens, vocab_size)
    if position is None:  # the .bin changed in place since the range was cached, and is fine now
        return
    value = ds.tokens[position]
    document, offset = ds.locate(position)
    fix = ("the data is corrupt: re-run tools/preprocess_data.py" if value < 0 else
           "the data was made with another tokenizer: pass the same --tokenizer-type/--tokenizer-model that "
           "tools/preprocess_data.py used, or re-run it with this run's tokenizer")
    raise TokenIdError(f"{_describe(value, document, offset, bin_path(ds.prefix), vocab_size)}; {fix}")


def refuse_sample(parts: list[np.ndarray], documents: np.ndarray, first_offset: int, prefix: str,
                  vocab_size: int) -> NoReturn:
    """Raise for a sample that ``in_vocab`` failed: ``parts`` from ``documents``, the first from ``first_offset``."""
    for k, part in enumerate(parts):
        if not in_vocab(part, vocab_size):
            i = int((~((part >= 0) & (part < vocab_size))).argmax())
            where = _describe(part[i], int(documents[k]), i + (first_offset if k == 0 else 0), bin_path(prefix),
                              vocab_size)
            raise TokenIdError(f"{where}: the data changed after the start-up check or is corrupt; "
                               "re-run tools/preprocess_data.py and restart")
    raise AssertionError("refuse_sample called for a sample whose ids are all in the vocabulary")
