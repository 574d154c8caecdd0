"""Continuous batching: n samples of each of P prompts through a fixed number of decoding slots.

The evaluation workload is many samples of one prompt, each ending at its own stop string. Here:

- **One prefill per prompt, its keys and values shared.** A prompt's keys and values (and the logits of its last
  position) are computed once, batch 1, and stored once as a prefix that each of its samples' slots points at: n
  samples cost one prefill, not n, and each decoding step reads the prompt's keys and values once for all n.
- **Finished rows leave at once.** When a row ends (end-of-document, an end id, a stop string, its max new
  tokens), the next waiting sample takes its slot -- from the same prompt or the next one, so one batch spans
  tasks -- and when none waits, the last busy slot moves into the hole: every step decodes busy rows only.
- **Stop strings incrementally** (``stops.py``): O(1) decoding per new token.

The slots (``model/kv_slots.py``) are allocated once: ``slots`` rows of max new tokens - 1 positions, and
min(slots, prompts) prefixes of the longest prompt's. Samples enter in order (prompt 0's samples 0..n-1, then
prompt 1's, ...) and come out as they finish, as (prompt * n + sample, token ids).

**Random streams.** Sample j of prompt i draws from its own ``torch.Generator`` seeded ``row_seed(seed, i, j)``
(sampling.py), one uniform per new token, on CPU (the same numbers on any device). Its tokens therefore depend
on the seed, i, j and its own logits only: not on the slot it gets, the batch size, its neighbours or when they
finish. The logits themselves can differ in the last bits between batch compositions (a matmul's blocking
depends on the batch size), which changes a token only where two candidates are within that rounding of a tie
(greedy) or u falls within it of a CDF step (sampled). On TP, the group's first rank chooses and broadcasts
(generator.py), and every decision here follows from the chosen tokens, so every rank batches alike.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field

import torch

from codegeex_train.generation.sampling import SamplingParams, row_seed


@dataclass
class Row:
    """One sample being decoded: sample ``sample`` of prompt ``prompt``, its random stream and tokens so far."""

    prompt: int
    sample: int
    max_new: int
    stream: torch.Generator | None
    tokens: list[int] = field(default_factory=list)


@dataclass
class _Prefix:
    """A prompt's prefix in the KV slots: its index there, the logits (1, v) of the prompt's last position, and how
    many of its samples are decoding."""

    index: int
    logits: torch.Tensor
    rows: int = 0


def sample_streams(params: SamplingParams, prompt: int, sample: int) -> torch.Generator | None:
    """Sample ``sample`` of prompt ``prompt``'s random stream (None when greedy)."""
    if params.greedy:
        return None
    return torch.Generator().manual_seed(row_seed(params.seed, prompt, sample))


def stream_batches(gen, prompt_ids: list[list[int]], params: SamplingParams, max_new: list[int], *,
                   num_samples: int, slots: int, end_ids: Collection[int], stops) -> Iterator[tuple[int, list[int]]]:
    """(prompt * num_samples + sample, new token ids) of every sample, as each finishes. ``gen`` is the
    Generator (its model, ``prefill``, ``decode_step``, ``choose``); ``max_new[i]``: prompt i's limit (> 0)."""
    n_rows = len(prompt_ids) * num_samples
    slots = max(1, min(slots, n_rows))
    # A row feeds back all its new tokens but the last; each busy prefix has a busy row, so <= slots are in use.
    cache = gen.model.new_kv_slots(slots, max(1, max(max_new) - 1), prefixes=min(slots, len(prompt_ids)),
                                   prefix_capacity=max(map(len, prompt_ids)))
    waiting = deque((i, j) for i in range(len(prompt_ids)) for j in range(num_samples))
    stop_ids = {gen.eod, *end_ids} - {None}
    rows: list[Row] = []
    decoded: torch.Tensor | None = None  # logits (len(rows), v) of the last decoding step
    loaded: dict[int, _Prefix] = {}  # prompt -> its prefix
    free = list(range(cache.prefixes))  # a heap of the prefixes not in use: the lowest is taken (a step reads 0 ..
    # the highest in use)
    while rows or waiting:
        fresh: list[torch.Tensor] = []  # the first-token logits of the rows admitted now: their prompt's
        while waiting and len(rows) < slots:  # waiting samples take the free slots, prompt by prompt
            i, j = waiting.popleft()
            if i not in loaded:
                prefill_cache, logits = gen.prefill(prompt_ids[i])
                loaded[i] = _Prefix(heapq.heappop(free), logits)
                cache.load_prefix(loaded[i].index, prefill_cache, len(prompt_ids[i]))
            cache.attach(len(rows), loaded[i].index)
            loaded[i].rows += 1
            rows.append(Row(i, j, max_new[i], sample_streams(params, i, j)))
            fresh.append(loaded[i].logits)
        logits = torch.cat(([] if decoded is None else [decoded]) + fresh)  # (len(rows), v) in slot order
        chosen = gen.choose(logits, params, rows).tolist()
        finished = []
        for k, (row, token) in enumerate(zip(rows, chosen)):
            if token in stop_ids:
                finished.append(k)
                continue
            row.tokens.append(token)
            if len(row.tokens) >= row.max_new or stops.hit(prompt_ids[row.prompt], row.tokens):
                finished.append(k)
        for k in reversed(finished):  # highest first: the last row is never one that is leaving
            row = rows[k]
            last = len(rows) - 1
            if k != last:
                cache.move(last, k)
                rows[k] = rows[last]
            rows.pop()
            loaded[row.prompt].rows -= 1
            if loaded[row.prompt].rows == 0 and not (waiting and waiting[0][0] == row.prompt):
                heapq.heappush(free, loaded.pop(row.prompt).index)  # its last sample: the prefix is free
            yield row.prompt * num_samples + row.sample, row.tokens
        decoded = None
        if rows:
            cache.rows = len(rows)
            tokens = torch.tensor([[row.tokens[-1]] for row in rows], dtype=torch.long, device=gen.device)
            decoded = gen.decode_step(tokens, cache)
