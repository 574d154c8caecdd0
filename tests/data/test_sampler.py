"""Distributed pretraining sampler: rank slices, resumption, argument checks."""

import itertools

import numpy as np
import pytest
import torch

from codegeex_train.data.sampler import PretrainingSampler, build_pretraining_data_loader

TOTAL, MICRO = 203, 3


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_ranks_partition_each_global_step(dp_size):
    per_rank = [list(PretrainingSampler(TOTAL, 0, MICRO, r, dp_size)) for r in range(dp_size)]
    steps = TOTAL // (MICRO * dp_size)
    assert all(len(batches) == steps for batches in per_rank)
    for step in range(steps):
        batches = [per_rank[r][step] for r in range(dp_size)]
        assert all(len(b) == MICRO for b in batches)
        union = sorted(itertools.chain(*batches))
        assert union == list(range(step * MICRO * dp_size, (step + 1) * MICRO * dp_size))


@pytest.mark.parametrize("dp_size", [1, 2, 4])
@pytest.mark.parametrize("steps_done", [0, 1, 5, 11])
def test_resume_matches_uninterrupted_run(dp_size, steps_done):
    consumed = steps_done * MICRO * dp_size
    for rank in range(dp_size):
        uninterrupted = list(PretrainingSampler(TOTAL, 0, MICRO, rank, dp_size))
        resumed = list(PretrainingSampler(TOTAL, consumed, MICRO, rank, dp_size))
        assert resumed == uninterrupted[steps_done:]
        assert len(PretrainingSampler(TOTAL, consumed, MICRO, rank, dp_size)) == len(resumed)


def test_last_partial_step_without_drop_last():
    batches = [list(PretrainingSampler(10, 0, 2, r, 2, drop_last=False)) for r in range(2)]
    assert batches[0][-1] == [8, 9] and batches[1][-1] == []
    assert list(PretrainingSampler(10, 0, 2, 0, 2)) == [[0, 1], [4, 5]]


@pytest.mark.parametrize(
    "args,message",
    [
        ((0, 0, 1, 0, 1), "total_samples"),
        ((10, 10, 1, 0, 1), "consumed_samples"),
        ((10, 0, 0, 0, 1), "micro-batch-size"),
        ((10, 0, 1, 2, 2), "rank 2"),
        ((10, 0, 1, 0, 0), "dp_size=0"),
    ],
)
def test_bad_arguments(args, message):
    with pytest.raises(ValueError, match=message):
        PretrainingSampler(*args)


class _Counting(torch.utils.data.Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        return {"text": np.arange(i, i + 5, dtype=np.int64)}


def test_data_loader_batches():
    loader = build_pretraining_data_loader(_Counting(), 8, 2, dp_rank=1, dp_size=2)
    first = next(iter(loader))["text"]
    assert first.dtype == torch.int64 and first.shape == (2, 5)
    assert first[:, 0].tolist() == [10, 11]
