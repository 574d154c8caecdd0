"""Which tokens a context-parallel rank holds: Megatron-core's load-balanced layout.

The sequence of length s is cut into 2N chunks of c = s / 2N for CP size N; CP rank r holds chunks r and 2N-1-r,
concatenated in that order (local length 2c). Under a causal mask an early chunk attends to few keys and a late one
to many, so pairing chunk r with its mirror gives every rank the same attention work. For N = 2, s = 8 (c = 2):

    global positions  0 1 | 2 3 | 4 5 | 6 7
    chunk             0   | 1   | 2   | 3
    rank 0 holds      0 1 6 7       rank 1 holds  2 3 4 5

The same cut applies to every per-token tensor of a batch (tokens, labels, loss mask, position ids (b, s), hidden
states (b, s, h)), along its sequence dimension. A pure function of the sizes: no process group.
"""

from __future__ import annotations

import torch

from codegeex_train.layout.plan import context_parallel_chunk_length


def check_context_parallel_length(seq_len: int, cp_size: int) -> int:
    """The chunk length c = s / 2N, or a one-line error naming the flags (the plan's rule)."""
    if cp_size < 1:
        raise ValueError(f"--context-parallel-size={cp_size}: must be >= 1")
    return context_parallel_chunk_length(seq_len, cp_size)


def context_parallel_indices(seq_len: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """The global positions CP rank ``cp_rank`` holds, in its local order: (2c,) int64."""
    c = check_context_parallel_length(seq_len, cp_size)
    first, second = cp_rank * c, (2 * cp_size - 1 - cp_rank) * c
    return torch.cat([torch.arange(first, first + c), torch.arange(second, second + c)])


def split_for_context_parallel(t: torch.Tensor, dim: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """This rank's two chunks of ``t`` along ``dim`` (length s -> 2c), concatenated; ``t`` itself at CP 1."""
    if cp_size == 1:
        return t
    c = check_context_parallel_length(t.shape[dim], cp_size)
    chunks = t.split(c, dim=dim)  # 2N views
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]], dim=dim)


def gather_from_context_parallel(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The inverse of ``split_for_context_parallel``: every rank's local tensor (CP rank order) -> the full one.
    A pure function for tests and tools (no communication)."""
    n = len(parts)
    if n == 1:
        return parts[0]
    local = parts[0].shape[dim]
    if local % 2 or any(p.shape[dim] != local for p in parts):
        raise ValueError(f"context-parallel parts must all hold 2 equal chunks along dim {dim}: "
                         f"got lengths {[p.shape[dim] for p in parts]}")
    halves = [p.split(local // 2, dim=dim) for p in parts]  # rank r: (chunk r, chunk 2N-1-r)
    chunks = [halves[r][0] for r in range(n)] + [halves[r][1] for r in reversed(range(n))]
    return torch.cat(chunks, dim=dim)
