"""Memory-mapped indexed dataset, byte-compatible with Megatron-LM's ``MMapIndexedDataset``.

A dataset is two files sharing a prefix:

* ``PREFIX.bin``: the token ids of every sequence, back to back, in one dtype.
* ``PREFIX.idx``: a little-endian index::

      magic            9 bytes   b"MMIDIDX\\x00\\x00"
      version          uint64    1
      dtype code       uint8     Megatron's table (_DTYPE_CODES)
      sequence count   uint64    n
      document count   uint64    len(document_indices) == n_docs + 1 (Megatron counts the leading 0)
      sequence lengths int32[n]
      sequence ptrs    int64[n]  byte offsets into .bin
      document indices int64[n_docs + 1]  sequence index where each document starts, then n

We write one sequence per document (no sentence splitting), so sequence i is document i.

Opening a dataset validates the whole index against the .bin (``_check_index``): a corrupt index is one
``IndexedDatasetError`` naming the first bad entry, never a wrong read or a traceback mid-run.
"""

from __future__ import annotations

import os
import struct
from typing import NoReturn, Sequence

import numpy as np

__all__ = [
    "IndexedDatasetBuilder",
    "IndexedDatasetError",
    "MMapIndexedDataset",
    "best_dtype",
    "bin_path",
    "idx_path",
    "merge_indexed_datasets",
    "write_index",
]

_MAGIC = b"MMIDIDX\x00\x00"
_VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, documents: 34 bytes
# Megatron's dtype codes; the numbers are part of the file format.
_DTYPE_CODES: dict[int, type[np.number]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF_DTYPE = {np.dtype(t): c for c, t in _DTYPE_CODES.items()}
# Index entries checked per numpy step: memory stays bounded for any number of documents.
_BLOCK = 1 << 22


class IndexedDatasetError(ValueError):
    """A .bin/.idx pair that cannot be read; the message names the file."""


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def best_dtype(vocab_size: int) -> type[np.number]:
    """Smallest dtype for token ids; the 65500 threshold is Megatron's (``DType.optimal_dtype``)."""
    return np.uint16 if vocab_size < 65500 else np.int32


def _fix(prefix: str) -> str:
    return f"re-run tools/preprocess_data.py to rebuild {prefix}.bin/.idx"


def _read_index(path: str) -> tuple[np.dtype, np.ndarray, np.ndarray, np.ndarray]:
    """Validate and memory-map an .idx file: (dtype, lengths, pointers, document_indices)."""
    size = os.path.getsize(path)
    if size < _HEADER.size:
        raise IndexedDatasetError(f"not a Megatron indexed dataset: file {path} ({size} bytes)")
    with open(path, "rb") as f:
        magic, version, code, n_seq, n_doc = _HEADER.unpack(f.read(_HEADER.size))
    if magic != _MAGIC:
        raise IndexedDatasetError(
            f"not a Megatron indexed dataset: file {path} (magic {magic!r}, expected {_MAGIC!r})"
        )
    if version != _VERSION:
        raise IndexedDatasetError(
            f"unsupported indexed dataset version {version} in {path} (only {_VERSION} is supported)"
        )
    if code not in _DTYPE_CODES:
        raise IndexedDatasetError(
            f"unknown dtype code {code} in {path} (known: {sorted(_DTYPE_CODES)})"
        )
    # Megatron's multimodal variant appends int8 modes (n_seq bytes); both sizes are fine.
    expected = _HEADER.size + 12 * n_seq + 8 * n_doc
    if size not in (expected, expected + n_seq):
        raise IndexedDatasetError(
            f"index {path} is {size} bytes but its header declares {n_seq} sequences and "
            f"{n_doc} document indices ({expected} bytes): truncated or corrupt; {_fix(path[:-len('.idx')])}"
        )
    buf = np.memmap(path, mode="r", dtype=np.uint8)
    off = _HEADER.size
    lengths = np.frombuffer(buf, dtype=np.int32, count=n_seq, offset=off)
    pointers = np.frombuffer(buf, dtype=np.int64, count=n_seq, offset=off + 4 * n_seq)
    doc_indices = np.frombuffer(buf, dtype=np.int64, count=n_doc, offset=off + 12 * n_seq)
    return np.dtype(_DTYPE_CODES[code]), lengths, pointers, doc_indices


def _first(bad, count: int) -> int | None:
    """The first i < count where ``bad(start, stop)`` (a boolean array for [start, stop)) is true, block by block."""
    for start in range(0, count, _BLOCK):
        mask = bad(start, min(start + _BLOCK, count))
        if mask.any():
            return start + int(mask.argmax())
    return None


def _check_index(prefix: str, dtype: np.dtype, lengths: np.ndarray, pointers: np.ndarray,
                 doc_indices: np.ndarray, bin_size: int) -> None:
    """Every entry of the index consistent with the others and with the .bin: vectorized, block by block.

    Megatron's builders lay the sequences out back to back, so pointer i must be the byte where sequence
    i - 1 ends: that one rule refuses negative, overlapping, non-monotone and out-of-file pointers alike.
    """
    idx, path, n = idx_path(prefix), bin_path(prefix), len(lengths)
    fix = f"the index is corrupt or belongs to another .bin: {_fix(prefix)}"
    if len(doc_indices) == 0 or doc_indices[0] != 0 or doc_indices[-1] != n:
        first, last = (doc_indices[0], doc_indices[-1]) if len(doc_indices) else ("none", "none")
        raise IndexedDatasetError(f"index {idx}: document indices must run from 0 to the sequence count {n} "
                                  f"(first {first}, last {last}); {fix}")
    i = _first(lambda a, b: doc_indices[a + 1:b + 1] < doc_indices[a:b], len(doc_indices) - 1)
    if i is not None:
        raise IndexedDatasetError(f"index {idx}: document index {i + 1} ({doc_indices[i + 1]}) is smaller than "
                                  f"the one before it ({doc_indices[i]}); {fix}")
    i = _first(lambda a, b: lengths[a:b] < 0, n)
    if i is not None:
        raise IndexedDatasetError(f"index {idx}: sequence {i} has a negative length ({lengths[i]}); {fix}")
    n_bytes = int(lengths.sum(dtype=np.int64)) * dtype.itemsize
    if bin_size != n_bytes:
        raise IndexedDatasetError(f"data file {path} is {bin_size} bytes but {idx} describes {n_bytes}: "
                                  f"truncated, or the .bin and .idx come from different runs; {_fix(prefix)}")
    end = 0  # byte where the sequence before the block ends
    for a in range(0, n, _BLOCK):
        sizes = lengths[a:a + _BLOCK].astype(np.int64) * dtype.itemsize
        starts = end + np.cumsum(sizes) - sizes
        bad = pointers[a:a + _BLOCK] != starts
        if bad.any():
            i = a + int(bad.argmax())
            _bad_pointer(prefix, dtype, i, int(pointers[i]), int(lengths[i]), int(starts[i - a]), bin_size, fix)
        end = int(starts[-1] + sizes[-1])


def _bad_pointer(prefix: str, dtype: np.dtype, i: int, pointer: int, length: int, expected: int, bin_size: int,
                 fix: str) -> NoReturn:
    """Raise the error naming pointer i and why it is wrong."""
    if pointer < 0:
        what = "a negative pointer"
    elif pointer > bin_size - length * dtype.itemsize:
        what = f"a pointer past the end: it would end at byte {pointer + length * dtype.itemsize}"
    elif pointer < expected:
        what = f"a pointer into the sequence before it (which ends at byte {expected})"
    else:
        what = f"a gap after the sequence before it (which ends at byte {expected})"
    raise IndexedDatasetError(
        f"index {idx_path(prefix)}: sequence {i} (pointer {pointer}, length {length} x {dtype.itemsize} bytes) "
        f"has {what}; {bin_path(prefix)} is {bin_size} bytes; {fix}")


class MMapIndexedDataset:
    """Read-only view of PREFIX.bin/.idx; ``ds[i]`` is sequence i as a (memory-mapped) array."""

    def __init__(self, prefix: str) -> None:
        for path in (idx_path(prefix), bin_path(prefix)):
            if not os.path.isfile(path):
                raise FileNotFoundError(
                    f"indexed dataset file {path} not found: create PREFIX.bin/.idx with "
                    f"tools/preprocess_data.py --output-prefix ... (prefix given: {prefix})"
                )
        self.prefix = prefix
        self.dtype, self._lengths, self._pointers, self._doc_indices = _read_index(idx_path(prefix))
        path = bin_path(prefix)
        n_bytes = os.path.getsize(path)
        _check_index(prefix, self.dtype, self._lengths, self._pointers, self._doc_indices, n_bytes)
        # np.memmap refuses empty files; an empty dataset is still a valid one.
        self._bin = (
            np.memmap(path, mode="r", dtype=np.uint8) if n_bytes else np.empty(0, np.uint8)
        )

    def __reduce__(self) -> tuple:
        # Pickle the path, not the mapped bytes (DataLoader workers under spawn pickle datasets).
        return (MMapIndexedDataset, (self.prefix,))

    def __len__(self) -> int:
        return len(self._lengths)

    def __getitem__(self, idx: int | np.integer | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(idx, slice):
            return [self.get(i) for i in range(*idx.indices(len(self)))]
        return self.get(idx)

    def get(self, idx: int | np.integer, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``idx`` (to its end when length is None)."""
        n = len(self)
        i = int(idx) + n if idx < 0 else int(idx)
        if not 0 <= i < n:
            raise IndexError(f"sequence {idx} out of range for {self.prefix} ({n} sequences)")
        size = int(self._lengths[i])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) out of sequence {i} of {size}")
        start = int(self._pointers[i]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, dtype=self.dtype, count=length, offset=start)

    @property
    def sequence_lengths(self) -> np.ndarray:
        return self._lengths

    @property
    def document_indices(self) -> np.ndarray:
        return self._doc_indices

    @property
    def tokens(self) -> np.ndarray:
        """Every token of the .bin file, sequence after sequence (memory-mapped)."""
        return np.frombuffer(self._bin, dtype=self.dtype)

    def locate(self, position: int) -> tuple[int, int]:
        """(sequence, offset in it) of token ``position`` of ``tokens``."""
        i = int(np.searchsorted(self._pointers, position * self.dtype.itemsize, side="right")) - 1
        return i, position - int(self._pointers[i]) // self.dtype.itemsize

    @property
    def num_tokens(self) -> int:
        return int(self._lengths.sum(dtype=np.int64))


class IndexedDatasetBuilder:
    """Streams documents into PREFIX.bin; ``finalize()`` writes PREFIX.idx.

    Both files are written under temporary names and renamed by ``finalize()``, so an
    interrupted run never leaves a pair that looks complete.
    """

    def __init__(self, prefix: str, dtype: type[np.number] | np.dtype = np.int32) -> None:
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF_DTYPE:
            raise ValueError(f"dtype {self.dtype} has no Megatron dtype code")
        self._tmp_bin = bin_path(prefix) + ".tmp"
        self._bin_file = open(self._tmp_bin, "wb")
        self._lengths: list[int] = []
        self._doc_indices: list[int] = [0]

    def add_document(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append one document, stored as one sequence."""
        array = np.asarray(tokens, dtype=self.dtype)
        self._bin_file.write(array.tobytes(order="C"))
        self._lengths.append(array.size)
        self._doc_indices.append(len(self._lengths))

    def add_index(self, prefix: str) -> None:
        """Append every document of an existing dataset (how per-worker outputs are merged)."""
        other = MMapIndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise IndexedDatasetError(
                f"cannot merge {prefix} ({other.dtype}) into {self.prefix} ({self.dtype})"
            )
        base = len(self._lengths)
        self._lengths.extend(other.sequence_lengths.tolist())
        self._doc_indices.extend((other.document_indices[1:] + base).tolist())
        with open(bin_path(prefix), "rb") as f:
            while chunk := f.read(1 << 24):
                self._bin_file.write(chunk)

    def finalize(self) -> None:
        self._bin_file.close()
        tmp_idx = idx_path(self.prefix) + ".tmp"
        write_index(tmp_idx, self.dtype, self._lengths, self._doc_indices)
        os.replace(self._tmp_bin, bin_path(self.prefix))
        os.replace(tmp_idx, idx_path(self.prefix))

    def __enter__(self) -> IndexedDatasetBuilder:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self.finalize()
                return
        except BaseException:
            self._discard()
            raise
        self._discard()

    def _discard(self) -> None:
        # Closing flushes, which fails again on a full disk: the .tmp files go regardless.
        try:
            self._bin_file.close()
        finally:
            for path in (self._tmp_bin, idx_path(self.prefix) + ".tmp"):
                if os.path.exists(path):
                    os.remove(path)


def write_index(path: str, dtype: np.dtype | type[np.number], lengths: Sequence[int] | np.ndarray,
                doc_indices: Sequence[int] | np.ndarray) -> None:
    """The .idx of sequences of ``lengths`` laid out back to back in the .bin; ``doc_indices`` from 0 to the count."""
    dtype = np.dtype(dtype)
    lengths = np.asarray(lengths, dtype=np.int32)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    doc_indices = np.asarray(doc_indices, dtype=np.int64)
    with open(path, "wb") as f:
        f.write(_HEADER.pack(_MAGIC, _VERSION, _CODE_OF_DTYPE[dtype], len(lengths), len(doc_indices)))
        f.write(lengths.tobytes())
        f.write(pointers.tobytes())
        f.write(doc_indices.tobytes())


def merge_indexed_datasets(prefixes: Sequence[str], output_prefix: str) -> None:
    """Concatenate datasets (same dtype) into one, documents in the given order."""
    if not prefixes:
        raise ValueError("merge_indexed_datasets needs at least one input prefix")
    dtype = MMapIndexedDataset(prefixes[0]).dtype
    with IndexedDatasetBuilder(output_prefix, dtype) as builder:
        for prefix in prefixes:
            builder.add_index(prefix)
