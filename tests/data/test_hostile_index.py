"""A hostile .idx/.bin pair either opens and reads exactly the bytes it describes, or is one IndexedDatasetError.

Never another exception type, never a read outside the sequence the index names (a negative or out-of-file pointer
used to read the wrong bytes, or to fail mid-run).
"""

import itertools
import struct

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from codegeex_train.data.indexed_dataset import (
    IndexedDatasetBuilder,
    IndexedDatasetError,
    MMapIndexedDataset,
    bin_path,
    idx_path,
)

HEADER = struct.Struct("<9sQBQQ")  # the file format (indexed_dataset.py's docstring): magic, version, code, n, docs
DTYPES = [np.uint8, np.int8, np.int16, np.int32, np.int64, np.float64, np.float32, np.uint16]
BOUNDED = settings(derandomize=True, database=None, max_examples=200, deadline=None)
_names = itertools.count()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("hostile")


def _pair(workdir, idx: bytes, data: bytes) -> str:
    prefix = str(workdir / f"case{next(_names)}")
    with open(idx_path(prefix), "wb") as f:
        f.write(idx)
    with open(bin_path(prefix), "wb") as f:
        f.write(data)
    return prefix


def _valid(workdir, docs, dtype) -> tuple[bytes, bytes]:
    prefix = str(workdir / f"valid{next(_names)}")
    with IndexedDatasetBuilder(prefix, dtype) as builder:
        for doc in docs:
            builder.add_document(doc)
    with open(idx_path(prefix), "rb") as f, open(bin_path(prefix), "rb") as g:
        return f.read(), g.read()


def _opens_and_reads_in_bounds(prefix: str, data: bytes) -> MMapIndexedDataset | None:
    """None for a refused pair (one IndexedDatasetError naming a file); else every sequence, in order, tiles .bin."""
    try:
        ds = MMapIndexedDataset(prefix)
    except IndexedDatasetError as e:
        message = str(e)
        assert "\n" not in message and (idx_path(prefix) in message or bin_path(prefix) in message), message
        return None
    documents = ds.document_indices  # documents are runs of sequences: 0, ..., len(ds) in order
    assert documents[0] == 0 and documents[-1] == len(ds) and (np.diff(documents) >= 0).all()
    itemsize, at = ds.dtype.itemsize, 0
    for i in range(len(ds)):
        tokens = ds[i]
        assert tokens.size == ds.sequence_lengths[i]
        assert tokens.tobytes() == data[at:at + tokens.size * itemsize]
        at += tokens.size * itemsize
    assert at == len(data) == ds.num_tokens * itemsize
    return ds


docs_strategy = st.lists(st.lists(st.integers(0, 120), max_size=6), max_size=6)
# Values near the real ones (sizes, offsets, indices) and anywhere in int64.
values = st.one_of(st.integers(-3, 40), st.sampled_from([2**31 - 1, -2**31, 2**62, 2**63 - 1, -2**63]),
                   st.integers(-2**63, 2**63 - 1))
CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.float64: 6, np.float32: 7, np.uint16: 8}


def _index_bytes(dtype, lengths, doc_indices) -> bytes:
    """An .idx whose pointers lay the sequences out back to back, as a writer would, whatever the lengths."""
    lengths = np.asarray(lengths, np.int32)
    pointers = (np.cumsum(lengths, dtype=np.int64) - lengths) * np.dtype(dtype).itemsize
    return (HEADER.pack(b"MMIDIDX\x00\x00", 1, CODES[dtype], len(lengths), len(doc_indices)) + lengths.tobytes()
            + pointers.tobytes() + np.asarray(doc_indices, np.int64).tobytes())


@st.composite
def laid_out(draw):
    """(idx, bin) of a self-consistent layout (a buggy writer): any small lengths, negative ones included, and
    document indices valid or anything near them; .bin exactly as long as the lengths add up to."""
    dtype = draw(st.sampled_from(DTYPES))
    lengths = draw(st.lists(st.integers(-2, 6), min_size=1, max_size=6))
    n = len(lengths)
    documents = draw(st.one_of(st.just(list(range(n + 1))), st.lists(st.integers(-1, n + 1), min_size=1,
                                                                       max_size=n + 2)))
    size = max(0, sum(lengths)) * np.dtype(dtype).itemsize
    return _index_bytes(dtype, lengths, documents), draw(st.binary(min_size=size, max_size=size))


@st.composite
def mutation(draw, idx: bytes):
    """One field of ``idx`` overwritten (offset, struct format, value), or either file cut or extended."""
    n_seq, n_doc = (struct.unpack_from("<QQ", idx, 18) if len(idx) >= HEADER.size else (0, 0))
    kind = draw(st.sampled_from(["pointer", "length", "doc_index", "byte", "n_seq", "n_doc", "truncate_idx",
                                 "extend_idx", "truncate_bin", "extend_bin", "code", "version"]))
    if kind == "length" and n_seq:
        i = draw(st.integers(0, n_seq - 1))
        return kind, HEADER.size + 4 * i, "<i", draw(values.map(lambda v: (v + 2**31) % 2**32 - 2**31))
    if kind == "pointer" and n_seq:
        i = draw(st.integers(0, n_seq - 1))
        return kind, HEADER.size + 4 * n_seq + 8 * i, "<q", draw(values)
    if kind == "doc_index" and n_doc:
        i = draw(st.integers(0, n_doc - 1))
        return kind, HEADER.size + 12 * n_seq + 8 * i, "<q", draw(values)
    if kind in ("n_seq", "n_doc", "version"):
        return kind, {"version": 9, "n_seq": 18, "n_doc": 26}[kind], "<Q", draw(values) % 2**64
    if kind == "code":
        return kind, 17, "<B", draw(st.integers(0, 255))
    if kind == "byte" and idx:
        return kind, draw(st.integers(0, len(idx) - 1)), "<B", draw(st.integers(0, 255))
    kind = kind if kind.startswith(("truncate", "extend")) else "extend_bin"
    return kind, draw(st.integers(1, 16)), None, draw(st.binary(min_size=1, max_size=16))


def _apply(idx: bytes, data: bytes, change) -> tuple[bytes, bytes]:
    kind, offset, fmt, value = change
    if fmt is not None:
        field = struct.pack(fmt, value)
        return (idx[:offset] + field + idx[offset + len(field):])[:max(len(idx), offset)], data
    if kind == "truncate_idx":
        return idx[:-offset], data
    if kind == "extend_idx":
        return idx + value, data
    if kind == "truncate_bin":
        return idx, data[:-offset]
    return idx, data + value


@st.composite
def valid_pair(draw):
    """(idx, bin) exactly as IndexedDatasetBuilder writes them (test_valid_index_reads_its_documents), in memory."""
    docs, dtype = draw(st.lists(st.lists(st.integers(0, 120), max_size=6), min_size=1, max_size=6)), draw(
        st.sampled_from(DTYPES))
    payload = b"".join(np.asarray(doc, dtype).tobytes() for doc in docs)
    return _index_bytes(dtype, [len(doc) for doc in docs], list(range(len(docs) + 1))), payload


@BOUNDED
@given(data=st.data())
def test_mutated_index(workdir, data):
    """A writer's index (ours, or a self-consistent buggy layout) with 1-3 fields or sizes changed."""
    idx, payload = data.draw(st.one_of(valid_pair(), laid_out()))
    for _ in range(data.draw(st.integers(1, 3))):
        change = data.draw(mutation(idx))
        event(change[0])
        idx, payload = _apply(idx, payload, change)
    event("refused" if _opens_and_reads_in_bounds(_pair(workdir, idx, payload), payload) is None else "opened")


@settings(derandomize=True, database=None, max_examples=100, deadline=None)
@given(pair=laid_out())
def test_buggy_writer_layout(workdir, pair):
    """Pointers where a writer puts them, but any small lengths (negative ones too) and any document indices."""
    idx, payload = pair
    _opens_and_reads_in_bounds(_pair(workdir, idx, payload), payload)


@settings(derandomize=True, database=None, max_examples=40, deadline=None)
@given(docs=docs_strategy, dtype=st.sampled_from(DTYPES))
def test_valid_index_reads_its_documents(workdir, docs, dtype):
    idx, payload = _valid(workdir, docs, dtype)
    assert (idx, payload) == (_index_bytes(dtype, [len(d) for d in docs], list(range(len(docs) + 1))),
                              b"".join(np.asarray(d, dtype).tobytes() for d in docs))
    ds = _opens_and_reads_in_bounds(_pair(workdir, idx, payload), payload)
    assert ds is not None and [list(ds[i]) for i in range(len(ds))] == [list(np.asarray(d, dtype)) for d in docs]


@settings(derandomize=True, database=None, max_examples=100, deadline=None)
@given(head=st.sampled_from([b"", b"MMIDIDX\x00\x00\x01\x00\x00\x00\x00\x00\x00\x00"]),
       tail=st.binary(max_size=120), payload=st.binary(max_size=64))
def test_random_bytes(workdir, head, tail, payload):
    """Any bytes (or a valid magic and version followed by any bytes) are refused or read in bounds."""
    _opens_and_reads_in_bounds(_pair(workdir, head + tail, payload), payload)


# One case of every corruption, each with the words a user needs: which entry, its values, the .bin size, the fix.
def _corrupt(workdir, field: str, i: int, value: int, docs=((1, 2, 3), (4, 5), (6,), (7, 8, 9, 10))) -> str:
    idx, payload = _valid(workdir, [list(d) for d in docs], np.uint16)
    n = len(docs)
    offset, fmt = {"length": (HEADER.size + 4 * i, "<i"), "pointer": (HEADER.size + 4 * n + 8 * i, "<q"),
                   "doc_index": (HEADER.size + 12 * n + 8 * i, "<q"), "n_seq": (18, "<Q"),
                   "n_doc": (26, "<Q")}[field]
    idx, payload = _apply(idx, payload, (field, offset, fmt, value))
    prefix = _pair(workdir, idx, payload)
    with pytest.raises(IndexedDatasetError) as info:
        MMapIndexedDataset(prefix)
    message = str(info.value)
    assert "tools/preprocess_data.py" in message and "\n" not in message, message
    return message


@pytest.mark.parametrize("field,i,value,fragments", [
    ("pointer", 1, -6, ["sequence 1 (pointer -6, length 2 x 2 bytes) has a negative pointer", "is 20 bytes"]),
    ("pointer", 3, 40, ["sequence 3 (pointer 40, length 4 x 2 bytes) has a pointer past the end",
                        "end at byte 48", "is 20 bytes"]),
    ("pointer", 3, 14, ["sequence 3 (pointer 14, length 4 x 2 bytes) has a pointer past the end", "byte 22"]),
    ("pointer", 2, 6, ["sequence 2 (pointer 6, length 1 x 2 bytes) has a pointer into the sequence before it",
                       "ends at byte 10"]),
    ("pointer", 1, 0, ["sequence 1 (pointer 0, length 2 x 2 bytes) has a pointer into"]),  # not monotone
    ("pointer", 1, 8, ["sequence 1 (pointer 8, length 2 x 2 bytes) has a gap"]),
    ("length", 2, -1, ["sequence 2 has a negative length (-1)"]),
    ("length", 0, 4, ["is 20 bytes but", "describes 22"]),  # one length too long: past the end of .bin
    ("doc_index", 2, 0, ["document index 2 (0) is smaller than the one before it (1)"]),
    ("doc_index", 2, 9, ["document index 3 (3) is smaller than the one before it (9)"]),  # out of range
    ("doc_index", 0, 1, ["must run from 0 to the sequence count 4 (first 1, last 4)"]),
    ("doc_index", 4, 3, ["must run from 0 to the sequence count 4 (first 0, last 3)"]),
    ("n_seq", 0, 5, ["header declares 5 sequences", "truncated or corrupt"]),
    ("n_doc", 0, 4, ["header declares 4 sequences and 4 document indices"]),
])
def test_each_corruption_names_the_entry_and_the_fix(workdir, field, i, value, fragments):
    message = _corrupt(workdir, field, i, value)
    for fragment in fragments:
        assert fragment in message, message


def test_truncated_index_names_the_fix(workdir):
    idx, payload = _valid(workdir, [[1, 2], [3]], np.int32)
    prefix = _pair(workdir, idx[:-3], payload)
    with pytest.raises(IndexedDatasetError, match=r"truncated or corrupt; re-run tools/preprocess_data.py"):
        MMapIndexedDataset(prefix)
