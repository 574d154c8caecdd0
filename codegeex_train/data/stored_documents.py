"""What a preprocessed dataset's documents show of how they were made, read from a few of them: whether they end
with the end-of-document token (tools/preprocess_data.py --append-eod) and whether they are repository documents
(--document-level repo: each opens with ``<repo_name>`` or ``<file_sep>``, sentinels that never come from text).

Training flags that need either act on nothing without it (training/batches.py's preflight refuses them). The index
says where each document starts and ends, so a check reads the edge tokens of ``SAMPLED_DOCUMENTS`` documents spread
over the dataset, never the whole .bin; the datasets of one preprocessing run are made alike, so a few tell.
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np

from codegeex_train.data.indexed_dataset import MMapIndexedDataset

__all__ = ["SAMPLED_DOCUMENTS", "holds_eod", "opens_with"]

SAMPLED_DOCUMENTS = 64
_SCAN_TOKENS = 1 << 16  # per document: an EOD inside documents tokenized elsewhere is found within this


def _sampled(ds: MMapIndexedDataset) -> list[int]:
    """Up to SAMPLED_DOCUMENTS non-empty documents, evenly spread from the first to the last."""
    spread = np.linspace(0, len(ds) - 1, min(len(ds), SAMPLED_DOCUMENTS)).round().astype(np.int64)
    lengths = ds.sequence_lengths
    return [int(i) for i in np.unique(spread) if lengths[i]]


def holds_eod(ds: MMapIndexedDataset, eod: int) -> bool:
    """Whether the documents hold the ``eod`` id: as the last token of one sampled (--append-eod puts it on each),
    or, for ids tokenized elsewhere that keep several documents in one, within the first ``_SCAN_TOKENS`` of one."""
    picked = _sampled(ds)
    lengths = ds.sequence_lengths
    if any(ds.get(i, int(lengths[i]) - 1, 1)[0] == eod for i in picked):
        return True
    return any(bool((ds.get(i, 0, min(int(lengths[i]), _SCAN_TOKENS)) == eod).any()) for i in picked)


def opens_with(ds: MMapIndexedDataset, ids: Collection[int]) -> bool:
    """Whether a sampled document's first token is one of ``ids``."""
    return any(int(ds.get(i, 0, 1)[0]) in ids for i in _sampled(ds))
