"""Packed GPT samples: stream tiling, splits, index cache, blends."""

import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from codegeex_train.data.blended_dataset import BlendedDataset, build_blending_indices
from codegeex_train.data.gpt_dataset import (
    GPTDataset,
    build_datasets_from_paths,
    build_sample_index,
    build_train_valid_test_datasets,
    parse_data_prefix,
    split_document_ranges,
)
from codegeex_train.data.indexed_dataset import MMapIndexedDataset
from tests.harness import write_indexed_dataset

TOKENS_PER_DOC_ID = 100  # document k holds tokens 100k, 100k+1, ...: a token names its document


def _write_corpus(prefix: str, n_docs: int = 10, seed: int = 0, base: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    docs = [
        (base + k) * TOKENS_PER_DOC_ID + np.arange(rng.integers(1, 40)) for k in range(n_docs)
    ]
    write_indexed_dataset(prefix, docs, np.uint16)
    return docs


def _check_tiling(sizes, documents, doc_idx, sample_idx, samples, seq_length):
    """Samples overlap by one token and, concatenated, are the epochs' token stream."""
    n_docs = len(documents)
    assert len(doc_idx) % n_docs == 0
    for epoch in range(len(doc_idx) // n_docs):
        assert sorted(doc_idx[epoch * n_docs : (epoch + 1) * n_docs]) == sorted(documents)
    stream = np.concatenate([np.arange(sizes[d]) + 1000 * d for d in doc_idx])
    assert len(sample_idx) == len(samples) + 1
    for j, sample in enumerate(samples):
        assert len(sample) == seq_length + 1
        assert np.array_equal(sample, stream[j * seq_length : (j + 1) * seq_length + 1])


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 12), min_size=1, max_size=8).filter(lambda s: sum(s) > 0),
    seq_length=st.integers(1, 9),
    num_samples=st.integers(1, 30),
    seed=st.integers(0, 2**31 - 1),
)
def test_sample_index_tiles_the_stream(sizes, seq_length, num_samples, seed):
    sizes = np.array(sizes, dtype=np.int32)
    documents = np.arange(len(sizes))
    doc_idx, sample_idx, shuffle_idx = build_sample_index(
        sizes, documents, seq_length, num_samples, seed
    )
    assert len(shuffle_idx) >= num_samples
    assert sorted(shuffle_idx) == list(range(len(sample_idx) - 1))

    def sample(j):  # read the sample the way GPTDataset does, on synthetic "documents"
        (d0, o0), (d1, o1) = sample_idx[j], sample_idx[j + 1]
        docs = [np.arange(sizes[doc_idx[k]]) + 1000 * doc_idx[k] for k in range(d0, d1 + 1)]
        docs[-1] = docs[-1][: o1 + 1]
        docs[0] = docs[0][o0:]
        return np.concatenate(docs)

    samples = [sample(j) for j in range(len(sample_idx) - 1)]
    _check_tiling(sizes, documents, doc_idx, sample_idx, samples, seq_length)
    # One epoch fewer would not have been enough.
    tokens_per_epoch = int(sizes.sum())
    epochs = len(doc_idx) // len(documents)
    assert epochs == 1 or ((epochs - 1) * tokens_per_epoch - 1) // seq_length < num_samples


def test_gpt_dataset_unshuffled_is_the_stream(tmp_path):
    prefix = str(tmp_path / "corpus")
    docs = _write_corpus(prefix)
    ds = GPTDataset(MMapIndexedDataset(prefix), "train", (0, 10), 7, 40, seed=3)
    assert len(ds) >= 40
    stream = np.concatenate([docs[d] for d in ds.doc_idx])
    inverse = np.argsort(ds.shuffle_idx)
    for j in range(len(ds)):
        text = ds[int(inverse[j])]["text"]
        assert text.dtype == np.int64
        assert np.array_equal(text, stream[7 * j : 7 * j + 8])


def test_split_ranges_like_megatron():
    assert split_document_ranges("969,30,1", 1000) == [(0, 969), (969, 999), (999, 1000)]
    assert split_document_ranges("969/30/1", 1000) == [(0, 969), (969, 999), (999, 1000)]
    assert split_document_ranges("1", 7) == [(0, 7), (7, 7), (7, 7)]
    assert split_document_ranges("98,2", 10) == [(0, 10), (10, 10), (10, 10)]
    with pytest.raises(ValueError, match="--split"):
        split_document_ranges("a,b", 10)


def test_samples_stay_inside_their_split(tmp_path):
    prefix = str(tmp_path / "corpus")
    _write_corpus(prefix, n_docs=20)
    train, valid, test = build_train_valid_test_datasets(
        [prefix], "6,2,2", seq_length=5, seed=1, train_valid_test_num_samples=(50, 20, 20)
    )
    for ds, (lo, hi) in zip((train, valid, test), [(0, 12), (12, 16), (16, 20)]):
        seen = set()
        for i in range(len(ds)):
            seen.update((ds[i]["text"] // TOKENS_PER_DOC_ID).tolist())
        assert seen == set(range(lo, hi))
    none = build_train_valid_test_datasets([prefix], "1,0,0", 5, 1, (10, 10, 0))
    assert none[1] is None and none[2] is None


def test_index_cache_reused_and_rebuilt(tmp_path):
    prefix = str(tmp_path / "corpus")
    _write_corpus(prefix)
    indexed = MMapIndexedDataset(prefix)
    first = GPTDataset(indexed, "train", (0, 10), 4, 30, seed=1)
    again = GPTDataset(indexed, "train", (0, 10), 4, 30, seed=1)
    assert not first.loaded_from_cache and again.loaded_from_cache
    assert np.array_equal(first.shuffle_idx, again.shuffle_idx)
    reseeded = GPTDataset(indexed, "train", (0, 10), 4, 30, seed=2)
    longer = GPTDataset(indexed, "train", (0, 10), 5, 30, seed=1)
    assert not reseeded.loaded_from_cache and not longer.loaded_from_cache
    assert not np.array_equal(reseeded.doc_idx, first.doc_idx)
    assert len({first.cache_stem, reseeded.cache_stem, longer.cache_stem}) == 3
    assert not list(tmp_path.glob("*.tmp*"))
    copy = pickle.loads(pickle.dumps(first))  # what a spawned DataLoader worker receives
    assert len(pickle.dumps(first)) < 2000
    assert all(np.array_equal(copy[i]["text"], first[i]["text"]) for i in range(len(first)))


def test_blending_indices_track_weights():
    weights = [0.5, 0.3, 0.15, 0.05]
    dataset_index, dataset_sample_index = build_blending_indices(weights, 2000)
    counts = np.zeros(len(weights))
    for step, d in enumerate(dataset_index, start=1):
        assert dataset_sample_index[step - 1] == counts[d]  # each dataset read in order
        counts[d] += 1
        assert np.all(np.abs(counts - np.array(weights) * step) <= 1)
    again = build_blending_indices(weights, 2000)
    assert np.array_equal(again[0], dataset_index) and np.array_equal(again[1], dataset_sample_index)
    with pytest.raises(ValueError, match="sum to 1"):
        build_blending_indices([0.5, 0.6], 10)


def test_blended_train_valid_test(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    _write_corpus(a, n_docs=10, seed=0, base=0)
    _write_corpus(b, n_docs=10, seed=1, base=10)
    train, valid, _ = build_train_valid_test_datasets(
        ["0.7", a, "0.3", b], "8,2,0", seq_length=6, seed=5, train_valid_test_num_samples=(100, 10, 0)
    )
    assert isinstance(train, BlendedDataset) and len(train) == 100
    assert np.bincount(train.dataset_index).tolist() == [70, 30]
    for i in range(len(train)):
        docs = set((train[i]["text"] // TOKENS_PER_DOC_ID).tolist())
        base = 10 * int(train.dataset_index[i])
        assert docs <= set(range(base, base + 8))  # the prefix's train documents only
    assert len(valid) == 10
    same = build_train_valid_test_datasets(["0.7", a, "0.3", b], "8,2,0", 6, 5, (100, 10, 0))[0]
    assert all(np.array_equal(same[i]["text"], train[i]["text"]) for i in range(0, 100, 7))


def test_separate_paths(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    _write_corpus(a, base=0)
    _write_corpus(b, base=10)
    train, valid, test = build_datasets_from_paths([a], [b], None, 4, 0, (20, 5, 5))
    assert test is None
    assert {int(t) // TOKENS_PER_DOC_ID for t in train[0]["text"]} <= set(range(10))
    assert {int(t) // TOKENS_PER_DOC_ID for t in valid[0]["text"]} <= set(range(10, 20))


def test_parse_data_prefix():
    assert parse_data_prefix(["A"]) == [(1.0, "A")]
    assert parse_data_prefix("3 A 1 B") == [(0.75, "A"), (0.25, "B")]
    with pytest.raises(ValueError, match="weight/prefix pairs"):
        parse_data_prefix(["0.5", "A", "B"])


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 12), min_size=1, max_size=8).filter(lambda s: sum(s) > 0),
    seq_length=st.integers(1, 9),
    fewer=st.integers(1, 30),
    more=st.integers(1, 60),
    seed=st.integers(0, 2**31 - 1),
)
def test_sample_index_for_more_samples_extends_the_index_for_fewer(sizes, seq_length, fewer, more, seed):
    # A run extended to more iterations (--train-iters raised on resume) must see, at every iteration it already
    # trained, the samples it saw: the longer index begins with the shorter one, whatever the epochs.
    sizes = np.array(sizes, dtype=np.int32)
    documents = np.arange(len(sizes))
    short = build_sample_index(sizes, documents, seq_length, fewer, seed)
    long = build_sample_index(sizes, documents, seq_length, fewer + more, seed)
    n = len(short[2])
    assert len(long[2]) >= n
    assert np.array_equal(long[0][: len(short[0])], short[0])
    assert np.array_equal(long[1][: len(short[1])], short[1])
    assert np.array_equal(long[2][:n], short[2])


def test_one_epoch_index_is_a_single_seeded_shuffle():
    # One epoch: the documents' order, then one shuffle of all samples, both from RandomState(seed) (the default
    # run's order, unchanged by the per-epoch streams of longer runs).
    sizes = np.array([5, 9, 3, 7, 11], dtype=np.int32)
    documents = np.arange(len(sizes))
    doc_idx, sample_idx, shuffle_idx = build_sample_index(sizes, documents, 4, 6, seed=3)
    rng = np.random.RandomState(3)
    assert np.array_equal(doc_idx, rng.permutation(documents))
    assert np.array_equal(shuffle_idx, rng.permutation((int(sizes.sum()) - 1) // 4))
