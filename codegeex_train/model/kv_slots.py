"""A key/value cache of fixed slots, one sequence each at its own length: what continuous batching decodes in.

``KVCache`` (attention.py) holds one batch that grows together, left-padded. Here every slot holds one sequence
from column 0 to its own length, so a slot can be emptied and refilled (a finished sample leaves, a new one takes
its place) without touching the others, and the buffers are allocated once for the whole run:

    slots = model.new_kv_slots(slots=16, capacity=prompt + new tokens)
    slots.load(row, prefill_cache, length)        # a prompt's keys/values, computed once, into slot ``row``
    slots.rows = b                                # the next forward decodes slots 0 .. b-1, one token each
    logits = model(next_ids, slots.positions(), kv_cache=slots, gather_logits=True, last_token_only=True)
    slots.move(src, dst)                          # compaction: the last busy slot fills a freed one

A decoding step writes each row's new key and value at column ``length[row]`` and attends over columns
0 .. max length, each row masked to its own; keys of a shorter row beyond its length are masked out (stale
values of an earlier occupant included). The model calls ``begin``/``slot(i).attend``/``commit`` as for KVCache.
"""

from __future__ import annotations

import torch

from codegeex_train.model.attention import KVCache, KVCacheSlot


class KVSlots:
    """(attentions, slots, heads/tp, capacity, d) keys and values; ``lengths`` (slots,) cached tokens per slot."""

    def __init__(self, num_attentions: int, slots: int, capacity: int, heads_per_partition: int, head_dim: int,
                 *, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        shape = (num_attentions, slots, heads_per_partition, capacity, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.slots, self.capacity = slots, capacity
        self.lengths = [0] * slots  # host copy: the mask's width without a device sync
        self._lengths = torch.zeros(slots, dtype=torch.long, device=device)
        self._rows = torch.arange(slots, device=device)
        self.rows = 0  # slots 0 .. rows-1 take part in the next forward
        self.mask: torch.Tensor | None = None
        self._end = 0

    def positions(self) -> torch.Tensor:
        """(rows, 1): the position of each decoding row's next token (= its cached length)."""
        return self._lengths[:self.rows, None].clone()

    def load(self, row: int, cache: KVCache, length: int, index: int = 0) -> None:
        """Slot ``row`` := the first ``length`` cached positions of row ``index`` of a prefilled, unpadded KVCache
        with the same attentions."""
        if length > self.capacity:
            raise ValueError(f"a sequence of {length} tokens does not fit the {self.capacity} cached positions")
        self.keys[:, row, :, :length] = cache.keys[:, index, :, :length]
        self.values[:, row, :, :length] = cache.values[:, index, :, :length]
        self._set_length(row, length)

    def move(self, src: int, dst: int) -> None:
        """Slot ``dst`` := slot ``src`` (its cached positions only)."""
        n = self.lengths[src]
        self.keys[:, dst, :, :n] = self.keys[:, src, :, :n]
        self.values[:, dst, :, :n] = self.values[:, src, :, :n]
        self._set_length(dst, n)

    def _set_length(self, row: int, length: int) -> None:
        self.lengths[row] = length
        self._lengths[row] = length

    # --- the model's side (as KVCache) -------------------------------------------------------------------

    def begin(self, seq_len: int, padding_mask: torch.Tensor | None = None) -> None:
        if seq_len != 1 or padding_mask is not None:
            raise ValueError("KVSlots decodes one new token per row (prefill a prompt in a KVCache, then load it)")
        b = self.rows
        if not 0 < b <= self.slots:
            raise ValueError(f"KVSlots.rows = {b}: set it to the number of decoding rows (1 .. {self.slots})")
        lengths = self.lengths[:b]
        self._end = max(lengths) + 1
        if self._end > self.capacity:
            raise ValueError(f"KV slots hold {self.capacity} positions; a row has {self._end - 1} cached + 1 new")
        if min(lengths) == self._end - 1:
            self.mask = None  # every row at the same length: every key visible
        else:
            columns = torch.arange(self._end, device=self._lengths.device)
            self.mask = (columns[None, :] <= self._lengths[:b, None])[:, None, None, :]  # (b, 1, 1, end)

    def update(self, index: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write attention ``index``'s new keys and values (b, heads/tp, 1, d) at each row's own column."""
        b = self.rows
        rows, columns = self._rows[:b], self._lengths[:b]
        self.keys[index, rows, :, columns] = k[:, :, 0]
        self.values[index, rows, :, columns] = v[:, :, 0]
        return self.keys[index, :b, :, :self._end], self.values[index, :b, :, :self._end]

    def commit(self) -> None:
        b = self.rows
        self._lengths[:b] += 1
        self.lengths[:b] = [n + 1 for n in self.lengths[:b]]
        self.mask = None

    def slot(self, index: int) -> KVCacheSlot:
        return KVCacheSlot(self, index)
