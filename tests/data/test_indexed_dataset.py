"""Indexed dataset: round trips, merge, byte compatibility with megatron-core, bad files."""

import os
import pickle
import struct
import warnings

import numpy as np
import pytest

from codegeex_train.data.indexed_dataset import (
    IndexedDatasetBuilder,
    IndexedDatasetError,
    MMapIndexedDataset,
    best_dtype,
    bin_path,
    idx_path,
    merge_indexed_datasets,
)

EOD = 0


def _documents(vocab_size: int, n: int = 20, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    docs = [np.append(rng.integers(1, vocab_size, rng.integers(1, 50)), EOD) for _ in range(n)]
    docs[3] = np.array([vocab_size - 1, EOD])  # the largest id must survive the dtype
    return docs


def _write(prefix: str, docs: list[np.ndarray], vocab_size: int) -> None:
    with IndexedDatasetBuilder(prefix, best_dtype(vocab_size)) as builder:
        for doc in docs:
            builder.add_document(doc)


@pytest.mark.parametrize("vocab_size,dtype", [(8192, np.uint16), (70000, np.int32)])
def test_round_trip(tmp_path, vocab_size, dtype):
    prefix = str(tmp_path / "corpus")
    docs = _documents(vocab_size)
    _write(prefix, docs, vocab_size)
    ds = MMapIndexedDataset(prefix)
    assert ds.dtype == dtype and len(ds) == len(docs)
    assert list(ds.document_indices) == list(range(len(docs) + 1))
    assert list(ds.sequence_lengths) == [len(d) for d in docs]
    for i, doc in enumerate(docs):
        assert np.array_equal(ds[i], doc) and ds[i][-1] == EOD
    assert np.array_equal(ds.get(5, offset=1, length=2), docs[5][1:3])
    assert np.array_equal(ds[-1], docs[-1])
    assert [list(x) for x in ds[2:4]] == [list(d) for d in docs[2:4]]
    assert ds.num_tokens == sum(len(d) for d in docs)
    assert not os.path.exists(bin_path(prefix) + ".tmp")
    copy = pickle.loads(pickle.dumps(ds))  # DataLoader workers: the path travels, not the data
    assert len(pickle.dumps(ds)) < 200 and np.array_equal(copy[7], docs[7])


def test_merge(tmp_path):
    docs = _documents(8192, n=9)
    parts = [str(tmp_path / f"part{k}") for k in range(3)]
    for k, prefix in enumerate(parts):
        _write(prefix, docs[3 * k : 3 * k + 3], 8192)
    merge_indexed_datasets(parts, str(tmp_path / "merged"))
    _write(str(tmp_path / "direct"), docs, 8192)
    for suffix in (".bin", ".idx"):
        merged = (tmp_path / ("merged" + suffix)).read_bytes()
        assert merged == (tmp_path / ("direct" + suffix)).read_bytes()


def test_empty_dataset(tmp_path):
    prefix = str(tmp_path / "empty")
    IndexedDatasetBuilder(prefix, np.uint16).finalize()
    assert len(MMapIndexedDataset(prefix)) == 0


@pytest.fixture(scope="module")
def megatron():
    try:
        with warnings.catch_warnings():  # megatron warns that Apex / Transformer Engine are absent
            warnings.simplefilter("ignore")
            from megatron.core.datasets import indexed_dataset
    except ImportError as err:  # pragma: no cover - megatron-core is a dev dependency
        # The independent reference for the file format: fail, never skip, so CI cannot pass without it.
        pytest.fail(f"megatron-core is not importable ({err}); `make env` installs it "
                    f"(pip install -e .[dev])", pytrace=False)
    return indexed_dataset


@pytest.mark.parametrize("vocab_size", [8192, 70000])
def test_megatron_reads_ours_and_writes_identical_bytes(tmp_path, megatron, vocab_size):
    docs = _documents(vocab_size)
    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
    _write(ours, docs, vocab_size)
    builder = megatron.IndexedDatasetBuilder(
        theirs + ".bin", dtype=megatron.DType.optimal_dtype(vocab_size)
    )
    for doc in docs:
        builder.add_document(doc, [len(doc)])
    builder.finalize(theirs + ".idx")
    for suffix in (".bin", ".idx"):
        assert open(ours + suffix, "rb").read() == open(theirs + suffix, "rb").read()
    read_by_megatron = megatron.IndexedDataset(ours)
    assert len(read_by_megatron) == len(docs)
    assert list(read_by_megatron.document_indices) == list(range(len(docs) + 1))
    for i, doc in enumerate(docs):
        assert np.array_equal(read_by_megatron[i], doc)
    read_by_us = MMapIndexedDataset(theirs)
    for i, doc in enumerate(docs):
        assert np.array_equal(read_by_us[i], doc)


def test_missing_files_point_to_preprocess(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nothing\.idx.*preprocess_data\.py"):
        MMapIndexedDataset(str(tmp_path / "nothing"))


def _valid(tmp_path) -> str:
    prefix = str(tmp_path / "data")
    _write(prefix, _documents(8192), 8192)
    return prefix


def test_truncated_bin(tmp_path):
    prefix = _valid(tmp_path)
    with open(bin_path(prefix), "r+b") as f:
        f.truncate(os.path.getsize(bin_path(prefix)) - 2)
    with pytest.raises(IndexedDatasetError, match=rf"{bin_path(prefix)}.*truncated"):
        MMapIndexedDataset(prefix)


def test_truncated_idx(tmp_path):
    prefix = _valid(tmp_path)
    with open(idx_path(prefix), "r+b") as f:
        f.truncate(100)
    with pytest.raises(IndexedDatasetError, match=rf"{idx_path(prefix)}.*truncated"):
        MMapIndexedDataset(prefix)


def test_foreign_file(tmp_path):
    prefix = _valid(tmp_path)
    with open(idx_path(prefix), "wb") as f:
        f.write(b'{"this": "is json, not an index"}')
    with pytest.raises(IndexedDatasetError, match=rf"not a Megatron indexed dataset: file {idx_path(prefix)}"):
        MMapIndexedDataset(prefix)


@pytest.mark.parametrize(
    "offset,value,message", [(9, struct.pack("<Q", 2), "unsupported .*version 2"), (17, b"\x09", "unknown dtype code 9")]
)
def test_bad_header_fields(tmp_path, offset, value, message):
    prefix = _valid(tmp_path)
    with open(idx_path(prefix), "r+b") as f:
        f.seek(offset)
        f.write(value)
    with pytest.raises(IndexedDatasetError, match=message) as info:
        MMapIndexedDataset(prefix)
    assert idx_path(prefix) in str(info.value)
