"""Packed GPT training samples over a Megatron indexed dataset, with splits and blends.

Megatron's scheme, rebuilt with numpy:

* ``--split 969,30,1`` cuts the *documents* of each prefix into train/valid/test ranges.
* ``doc_idx``: the split's documents, shuffled independently for every epoch, concatenated;
  the number of epochs is the fewest that yield the requested number of samples.
* ``sample_idx[i] = (position in doc_idx, token offset)`` where sample i starts. A sample is
  ``seq_length + 1`` tokens and the next one starts on its last token, so the inputs
  (``text[:-1]``) and labels (``text[1:]``) of consecutive samples tile the token stream.
* ``shuffle_idx``: a permutation of the samples; ``dataset[i]`` is sample ``shuffle_idx[i]``. Epoch e's block of
  samples (those complete within the first e + 1 epochs, not in an earlier block) is shuffled on its own, each epoch
  from a random stream of its own, so that the index for more samples begins with the index for fewer: a run extended
  to more iterations (a larger --train-iters) sees the same samples at every iteration it had already trained.
  (Megatron shuffles all epochs together, so its order changes with --train-iters.) One epoch is exactly the
  former single shuffle.

The three arrays are cached as .npy next to the data under a hash of their inputs. Given the model's
(padded) vocabulary size, every sample's ids are checked against it (token_range.in_vocab). With a ``fim``
transform (--fim-rate), the training split's samples are served through ``fim.FIMDataset`` (validation and test
stay left-to-right; fim.py says why).
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np
import torch

from codegeex_train.data.blended_dataset import BlendedDataset, build_blended_dataset
from codegeex_train.data.fim import FIM, FIMDataset
from codegeex_train.data.indexed_dataset import MMapIndexedDataset
from codegeex_train.data.npy_cache import cache_key, load_or_build
from codegeex_train.data.token_range import in_vocab, refuse_sample

__all__ = [
    "GPTDataset",
    "build_datasets_from_paths",
    "build_sample_index",
    "build_train_valid_test_datasets",
    "parse_data_prefix",
    "split_document_ranges",
]

SPLIT_NAMES = ("train", "valid", "test")
_ARRAYS = ("doc_idx", "sample_idx", "shuffle_idx")
_INDEX_FORMAT = 2  # bump when the index-building algorithm changes, to invalidate caches


def parse_data_prefix(data_prefix: Sequence[str] | str) -> list[tuple[float, str]]:
    """``["A"]`` or ``["0.7", "A", "0.3", "B"]`` (Megatron's --data-path) -> normalized (w, prefix)."""
    items = data_prefix.split() if isinstance(data_prefix, str) else list(data_prefix)
    if len(items) == 1:
        return [(1.0, items[0])]
    if not items or len(items) % 2:
        raise ValueError(
            f"data path {items}: give one prefix, or weight/prefix pairs like 0.7 A 0.3 B"
        )
    try:
        weights = [float(w) for w in items[0::2]]
    except ValueError as err:
        raise ValueError(f"data path {items}: expected weight/prefix pairs ({err})") from None
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"data path {items}: weights must be >= 0 with a positive sum")
    total = sum(weights)
    return [(w / total, p) for w, p in zip(weights, items[1::2])]


def split_document_ranges(split: str, num_documents: int) -> list[tuple[int, int]]:
    """Megatron's --split ("969,30,1" or "969/30/1") -> [start, stop) document ranges, 3 of them."""
    sep = "/" if "/" in split else ","
    try:
        weights = [float(s) for s in split.split(sep) if s.strip()]
    except ValueError:
        raise ValueError(f"--split {split!r}: expected up to 3 numbers like 969,30,1") from None
    if not 1 <= len(weights) <= 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"--split {split!r}: expected 1-3 non-negative numbers, positive sum")
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w / total * num_documents)))
    # Rounding can overshoot or undershoot; like Megatron, shift every boundary by the error.
    diff = bounds[-1] - num_documents
    bounds = [0] + [max(b - diff, 0) for b in bounds[1:]]
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


def build_sample_index(
    sizes: np.ndarray, documents: np.ndarray, seq_length: int, num_samples: int, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(doc_idx, sample_idx, shuffle_idx) for ``num_samples`` or more samples; pure, seeded. The arrays for more
    samples begin with the arrays for fewer (prefix-stable): each epoch draws its documents' order and its block's
    shuffle from its own stream (epoch 0: ``seed``; epoch e: ``(seed, e)``)."""
    tokens_per_epoch = int(sizes[documents].sum(dtype=np.int64))
    if tokens_per_epoch < 1:
        raise ValueError("the documents of this split hold no tokens")
    # Samples complete within e epochs: (e * tokens_per_epoch - 1) // seq_length; epoch e's block ends there.
    num_epochs = max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))
    block_ends = [((e + 1) * tokens_per_epoch - 1) // seq_length for e in range(num_epochs)]
    streams = [np.random.RandomState(seed if e == 0 else [seed, e]) for e in range(num_epochs)]
    doc_idx = np.concatenate([rng.permutation(documents) for rng in streams])
    doc_idx = doc_idx.astype(np.int32)
    ends = np.cumsum(sizes[doc_idx], dtype=np.int64)
    starts = ends - sizes[doc_idx]
    total_samples = block_ends[-1]
    positions = np.arange(total_samples + 1, dtype=np.int64) * seq_length
    # The document holding each position; side="right" steps over empty documents.
    where = np.searchsorted(ends, positions, side="right")
    sample_idx = np.stack([where, positions - starts[where]], axis=1).astype(np.int64)
    block_starts = [0, *block_ends[:-1]]
    shuffle_idx = np.concatenate([begin + rng.permutation(end - begin)
                                  for rng, begin, end in zip(streams, block_starts, block_ends)]).astype(np.int64)
    return doc_idx, sample_idx, shuffle_idx


class GPTDataset(torch.utils.data.Dataset):
    """Samples of ``seq_length + 1`` tokens packed from documents ``[start, stop)`` of a prefix.

    ``len()`` is at least ``num_samples`` (the last epoch is used in full). With ``vocab_size``, a sample holding
    an id outside [0, vocab_size) raises ``TokenIdError`` naming the file and the document.
    """

    def __init__(
        self,
        indexed: MMapIndexedDataset,
        name: str,
        document_range: tuple[int, int],
        seq_length: int,
        num_samples: int,
        seed: int,
        cache_dir: str | None = None,
        vocab_size: int | None = None,
    ) -> None:
        start, stop = document_range
        if not 0 <= start < stop <= len(indexed):
            raise ValueError(
                f"{name} split of {indexed.prefix}: document range [{start}, {stop}) is empty or "
                f"outside its {len(indexed)} documents; adjust --split or the sample counts"
            )
        if seq_length < 1 or num_samples < 1:
            raise ValueError(f"seq_length ({seq_length}) and num_samples ({num_samples}) must be >= 1")
        sizes = indexed.sequence_lengths
        if not sizes[start:stop].any():
            raise ValueError(f"{name} split of {indexed.prefix}: documents [{start}, {stop}) are empty")
        self.indexed, self.name, self.seq_length, self.vocab_size = indexed, name, seq_length, vocab_size
        description = {
            "format": _INDEX_FORMAT,
            "prefix": os.path.abspath(indexed.prefix),
            "num_documents": len(indexed),
            "num_tokens": indexed.num_tokens,
            "document_range": [start, stop],
            "seq_length": seq_length,
            "num_samples": num_samples,
            "seed": seed,
        }
        directory = cache_dir or os.path.dirname(os.path.abspath(indexed.prefix))
        stem = os.path.join(
            directory, f"{os.path.basename(indexed.prefix)}_{name}_{cache_key(description)}"
        )
        documents = np.arange(start, stop, dtype=np.int64)
        arrays, self.loaded_from_cache = load_or_build(
            stem,
            _ARRAYS,
            lambda: build_sample_index(sizes, documents, seq_length, num_samples, seed),
        )
        self.doc_idx, self.sample_idx, self.shuffle_idx = arrays
        self.cache_stem = stem

    def __getstate__(self) -> dict:
        # DataLoader workers started by spawn re-map the cached files instead of copying arrays.
        return {k: v for k, v in self.__dict__.items() if k not in _ARRAYS}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        for name in _ARRAYS:
            setattr(self, name, np.load(f"{self.cache_stem}_{name}.npy", mmap_mode="r"))

    def __len__(self) -> int:
        return len(self.shuffle_idx)

    def sample(self, j: int) -> np.ndarray:
        """Unshuffled sample ``j``: the stream's tokens ``[j * seq_length, (j + 1) * seq_length]``."""
        (doc_start, off_start), (doc_end, off_end) = self.sample_idx[j], self.sample_idx[j + 1]
        get, doc_idx = self.indexed.get, self.doc_idx
        if doc_start == doc_end:
            parts = [get(doc_idx[doc_start], int(off_start), int(off_end - off_start + 1))]
        else:
            parts = [get(doc_idx[doc_start], int(off_start))]
            parts += [get(doc_idx[k]) for k in range(doc_start + 1, doc_end)]
            parts.append(get(doc_idx[doc_end], 0, int(off_end + 1)))
        tokens = np.concatenate(parts)
        if self.vocab_size is not None and not in_vocab(tokens, self.vocab_size):
            refuse_sample(parts, doc_idx[doc_start:doc_end + 1], int(off_start), self.indexed.prefix, self.vocab_size)
        return tokens.astype(np.int64)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return {"text": self.sample(int(self.shuffle_idx[i]))}


def _with_fim(split_index: int, dataset, fim: FIM | None, seed: int):
    """FIM transforms the training split only (validation stays left to right: comparable at any rate)."""
    if fim is None or dataset is None or SPLIT_NAMES[split_index] != "train":
        return dataset
    return FIMDataset(dataset, fim, seed)


def _build_samples(
    split_index: int,
    blend: list[tuple[float, MMapIndexedDataset, tuple[int, int]]],
    seq_length: int,
    seed: int,
    num_samples: int,
    cache_dir: str | None,
    vocab_size: int | None,
) -> GPTDataset | BlendedDataset | None:
    name = SPLIT_NAMES[split_index]
    # A prefix whose share of this split is empty drops out of the blend (Megatron returns None
    # for an empty split, and training then skips evaluation).
    blend = [(w, ds, r) for w, ds, r in blend if r[1] > r[0] and w > 0]
    if num_samples <= 0 or not blend:
        return None
    if len(blend) == 1:
        _, ds, doc_range = blend[0]
        return GPTDataset(ds, name, doc_range, seq_length, num_samples, seed, cache_dir, vocab_size)
    total = sum(w for w, _, _ in blend)

    def make(i: int, n: int) -> GPTDataset:
        _, ds, doc_range = blend[i]
        return GPTDataset(ds, name, doc_range, seq_length, n, seed, cache_dir, vocab_size)

    description = [(w, os.path.abspath(ds.prefix), list(r)) for w, ds, r in blend]
    directory = cache_dir or os.path.dirname(os.path.abspath(blend[0][1].prefix))
    stem = os.path.join(directory, f"blend_{name}_{cache_key({'blend': description, 'n': num_samples})}")
    return build_blended_dataset([w / total for w, _, _ in blend], make, num_samples, stem)


def build_train_valid_test_datasets(
    data_prefix: Sequence[str] | str,
    split: str,
    seq_length: int,
    seed: int,
    train_valid_test_num_samples: tuple[int, int, int],
    cache_dir: str | None = None,
    vocab_size: int | None = None,
    fim: FIM | None = None,
) -> tuple[GPTDataset | BlendedDataset | FIMDataset | None, ...]:
    """Megatron's --data-path + --split: each prefix split by documents, then blended per split.

    A split with no documents or no requested samples is None; ``vocab_size``: check every sample's ids; ``fim``:
    transform the training split.
    """
    blend = [(w, MMapIndexedDataset(p)) for w, p in parse_data_prefix(data_prefix)]
    ranges = [split_document_ranges(split, len(ds)) for _, ds in blend]
    return tuple(
        _with_fim(k, _build_samples(k, [(w, ds, r[k]) for (w, ds), r in zip(blend, ranges)], seq_length, seed,
                                    train_valid_test_num_samples[k], cache_dir, vocab_size), fim, seed)
        for k in range(3)
    )


def build_datasets_from_paths(
    train_data_path: Sequence[str] | str | None,
    valid_data_path: Sequence[str] | str | None,
    test_data_path: Sequence[str] | str | None,
    seq_length: int,
    seed: int,
    train_valid_test_num_samples: tuple[int, int, int],
    cache_dir: str | None = None,
    vocab_size: int | None = None,
    fim: FIM | None = None,
) -> tuple[GPTDataset | BlendedDataset | FIMDataset | None, ...]:
    """Megatron's --train-data-path/--valid-data-path/--test-data-path: whole prefixes per split; ``fim``: transform
    the training split."""
    datasets = []
    for k, path in enumerate((train_data_path, valid_data_path, test_data_path)):
        if not path:
            datasets.append(None)
            continue
        blend = [(w, MMapIndexedDataset(p)) for w, p in parse_data_prefix(path)]
        datasets.append(
            _with_fim(k, _build_samples(k, [(w, ds, (0, len(ds))) for w, ds in blend], seq_length, seed,
                                        train_valid_test_num_samples[k], cache_dir, vocab_size), fim, seed)
        )
    return tuple(datasets)
