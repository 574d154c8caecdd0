"""The load-balanced layout of context parallelism (no process group): split then gather gives the input back, the
chunks are the documented ones, and a length that does not divide fails with one line naming both flags."""

import pytest
import torch

from codegeex_train.context_parallel import (
    context_parallel_indices,
    gather_from_context_parallel,
    split_for_context_parallel,
)


def test_documented_example():
    positions = torch.arange(8).expand(2, 8)  # (b, s) position ids
    assert split_for_context_parallel(positions, 1, 0, 2).tolist() == [[0, 1, 6, 7]] * 2
    assert split_for_context_parallel(positions, 1, 1, 2).tolist() == [[2, 3, 4, 5]] * 2


@pytest.mark.parametrize("cp_size", [1, 2, 4])
@pytest.mark.parametrize("shape, dim", [((2, 24), 1), ((2, 24, 5), 1), ((3, 2, 24, 4), 2), ((24,), -1)])
def test_split_then_gather_is_the_identity(cp_size, shape, dim):
    t = torch.randn(shape)
    s = t.shape[dim]
    parts = [split_for_context_parallel(t, dim, r, cp_size) for r in range(cp_size)]
    for r, part in enumerate(parts):
        assert part.shape[dim] == s // cp_size
        # the rank's tokens are its chunks r and 2N-1-r, in that order
        assert torch.equal(part, t.index_select(dim, context_parallel_indices(s, r, cp_size)))
    assert torch.equal(gather_from_context_parallel(parts, dim), t)


def test_every_position_held_once():
    for cp_size in (2, 4):
        held = torch.cat([context_parallel_indices(16 * cp_size, r, cp_size) for r in range(cp_size)])
        assert sorted(held.tolist()) == list(range(16 * cp_size))


@pytest.mark.parametrize("seq_len, cp_size", [(10, 4), (6, 2)])
def test_length_not_divisible_names_the_flags(seq_len, cp_size):
    with pytest.raises(ValueError) as e:
        split_for_context_parallel(torch.zeros(1, seq_len), 1, 0, cp_size)
    message = str(e.value)
    assert "\n" not in message and "--seq-length" in message and "--context-parallel-size" in message
    assert str(seq_len) in message and str(2 * cp_size) in message


def test_gather_refuses_uneven_parts():
    with pytest.raises(ValueError, match="2 equal chunks"):
        gather_from_context_parallel([torch.zeros(4), torch.zeros(6)], 0)
