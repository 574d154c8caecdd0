"""A key/value cache of fixed slots sharing their prompts' keys and values: what continuous batching decodes in.

``KVCache`` (attention.py) holds one batch that grows together, left-padded. Here the n samples of a prompt share
one copy of its keys and values (a **prefix**, stored once), and every slot holds only its own sample's new tokens
from column 0 to its own length. A slot can be emptied and refilled (a finished sample leaves, a new one takes its
place) without touching the others, and every buffer is allocated once for the whole run:

    slots = model.new_kv_slots(slots=16, capacity=max new tokens, prefixes=4, prefix_capacity=longest prompt)
    slots.load_prefix(p, prefill_cache, length)   # a prompt's keys/values, computed once, into prefix ``p``
    slots.attach(row, p)                          # slot ``row`` starts a sample of that prompt
    slots.rows = b                                # the next forward decodes slots 0 .. b-1, one token each
    logits = model(next_ids, slots.positions(), kv_cache=slots, gather_logits=True, last_token_only=True)
    slots.move(src, dst)                          # compaction: the last busy slot fills a freed one

A decoding step writes each row's new key and value at column ``length[row]`` of its slot and attends over its
prefix and its slot together (one softmax over both). The prefixes are read once per step for all their rows (the
rows of a prefix go through one matmul, as a group), not once per row: n samples of a 600-token prompt read its
keys and values once instead of n times, the step's dominant memory traffic. Keys of a shorter row or prefix
beyond its length are masked out (stale values of an earlier occupant included). The model calls
``begin``/``slot(i).attend``/``commit`` as for KVCache.

Under grouped-query attention the buffers hold this rank's key-value groups, and the n/g query heads of a group go
through its matmul together (as n/g more query rows), so each group is read once for its heads. Under a sliding
window (--window-size W) a row at position p sees the prefix and own keys at positions > p - W only.
"""

from __future__ import annotations

import math

import torch

from codegeex_train.model.attention import KVCache


def _grouped(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, n, L, X) per query head -> (B, g, n/g · L, X): each group's heads as rows of one matmul (head j is in
    group j // (n/g)); ``x`` itself when g = n."""
    return x if x.shape[1] == groups else x.reshape(x.shape[0], groups, -1, x.shape[-1])


def _per_head(x: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of ``_grouped``: (B, g, n/g · L, X) -> (B, n, L, X)."""
    return x if x.shape[1] == heads else x.reshape(x.shape[0], heads, -1, x.shape[-1])


class KVSlots:
    """Per attention, prefixes (prefixes, kv heads/tp, prefix_capacity, d) and slots (slots, kv heads/tp, capacity, d)
    of keys and values (``kv_heads``: the key-value groups, as KVCache's); each slot points at one prefix and holds
    ``lengths[row]`` tokens of its own."""

    def __init__(self, num_attentions: int, slots: int, capacity: int, kv_heads: int | list[int], head_dim: int,
                 *, prefixes: int, prefix_capacity: int, window: int | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        heads = [kv_heads] * num_attentions if isinstance(kv_heads, int) else list(kv_heads)
        if len(heads) != num_attentions:
            raise ValueError(f"kv_heads: {len(heads)} counts for {num_attentions} attentions")
        kw = {"dtype": dtype, "device": device}
        self.keys = [torch.zeros(slots, n, capacity, head_dim, **kw) for n in heads]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.prefix_keys = [torch.zeros(prefixes, n, prefix_capacity, head_dim, **kw) for n in heads]
        self.prefix_values = [torch.zeros_like(k) for k in self.prefix_keys]
        self.slots, self.capacity, self.prefixes, self.prefix_capacity = slots, capacity, prefixes, prefix_capacity
        self.window = window
        self.scale = 1.0 / math.sqrt(head_dim)
        self.device = self.keys[0].device
        # host copies: the step's shapes without a device sync
        self.lengths = [0] * slots
        self.prefix_of = [0] * slots
        self.prefix_lengths = [0] * prefixes
        self._lengths = torch.zeros(slots, dtype=torch.long, device=device)
        self._rows = torch.arange(slots, device=device)
        self.rows = 0  # slots 0 .. rows-1 take part in the next forward
        self.step: _Step | None = None

    def positions(self) -> torch.Tensor:
        """(rows, 1): the position of each decoding row's next token (its prefix's length + its own)."""
        b = self.rows
        return torch.tensor([[self.prefix_lengths[self.prefix_of[r]] + self.lengths[r]] for r in range(b)],
                            dtype=torch.long, device=self.device)

    def load_prefix(self, prefix: int, cache: KVCache, length: int, index: int = 0) -> None:
        """Prefix ``prefix`` := the first ``length`` cached positions of row ``index`` of a prefilled, unpadded
        KVCache with the same attentions."""
        if length > self.prefix_capacity:
            raise ValueError(f"a prompt of {length} tokens does not fit the {self.prefix_capacity} prefix positions")
        for mine, theirs in zip(self.prefix_keys + self.prefix_values, cache.keys + cache.values, strict=True):
            mine[prefix, :, :length] = theirs[index, :, :length]
        self.prefix_lengths[prefix] = length

    def attach(self, row: int, prefix: int) -> None:
        """Slot ``row`` starts a new sample of prefix ``prefix``'s prompt (no tokens of its own yet)."""
        self.prefix_of[row] = prefix
        self._set_length(row, 0)

    def move(self, src: int, dst: int) -> None:
        """Slot ``dst`` := slot ``src`` (its prefix and its own cached positions)."""
        n = self.lengths[src]
        for buffer in self.keys + self.values:
            buffer[dst, :, :n] = buffer[src, :, :n]
        self.prefix_of[dst] = self.prefix_of[src]
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
        if max(self.lengths[:b]) + 1 > self.capacity:
            raise ValueError(f"KV slots hold {self.capacity} positions; a row has {max(self.lengths[:b])} cached + 1 "
                             f"new")
        self.step = _Step(self, b)

    def update(self, index: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write attention ``index``'s new keys and values (b, kv heads/tp, 1, d) at each row's own column."""
        b = self.rows
        rows, columns = self._rows[:b], self._lengths[:b]
        self.keys[index][rows, :, columns] = k[:, :, 0]
        self.values[index][rows, :, columns] = v[:, :, 0]

    def commit(self) -> None:
        b = self.rows
        self._lengths[:b] += 1
        self.lengths[:b] = [n + 1 for n in self.lengths[:b]]
        self.step = None

    def slot(self, index: int) -> "KVSlotsAttention":
        return KVSlotsAttention(self, index)


class _Step:
    """What every attention of one decoding step shares: the rows grouped by prefix, the masks, the widths."""

    def __init__(self, slots: KVSlots, b: int):
        device = slots.device
        prefix_of = slots.prefix_of[:b]
        self.used = max(prefix_of) + 1  # prefixes 0 .. used-1 are read (the lowest free one is always taken)
        groups: list[list[int]] = [[] for _ in range(self.used)]
        place = []  # row -> its place (prefix, index in the group)
        for r, p in enumerate(prefix_of):
            place.append((p, len(groups[p])))
            groups[p].append(r)
        width = max(map(len, groups))
        # (used, width) rows of each prefix's group; b (a zero query row) where a group is shorter
        self.group_rows = torch.tensor([g + [b] * (width - len(g)) for g in groups], dtype=torch.long, device=device)
        self.group_of = torch.tensor([p for p, _ in place], dtype=torch.long, device=device)
        self.index_in_group = torch.tensor([j for _, j in place], dtype=torch.long, device=device)
        lengths = [slots.prefix_lengths[p] if groups[p] else 1 for p in range(self.used)]
        self.prefix_end = max(lengths)
        columns = torch.arange(self.prefix_end, device=device)
        self.prefix_mask = (columns[None, :] < torch.tensor(lengths, device=device)[:, None])[:, None, None, :]
        self.end = max(slots.lengths[:b]) + 1  # own columns 0 .. end-1 (the new token's included)
        own = torch.arange(self.end, device=device)
        self.own_mask = (own[None, :] <= slots._lengths[:b, None])[:, None, None, :]  # (b, 1, 1, end)
        self.prefix_window = None  # (b, 1, P) under a sliding window: the prefix keys each row still sees
        if slots.window is not None:
            # row r decodes position p = prefix length + own length; keys at positions > p - W stay visible
            oldest = torch.tensor([slots.prefix_lengths[p] + slots.lengths[r] - slots.window + 1
                                   for r, p in enumerate(prefix_of)], dtype=torch.long, device=device)  # (b,)
            self.prefix_window = (columns[None, :] >= oldest[:, None])[:, None, :]
            own_oldest = slots._lengths[:b] - slots.window + 1  # the same bound in own columns
            self.own_mask = self.own_mask & (own[None, :] >= own_oldest[:, None])[:, None, None, :]


class KVSlotsAttention:
    """One attention's view of KVSlots: store this step's keys and values, attend over prefix + own tokens."""

    def __init__(self, slots: KVSlots, index: int):
        self.slots, self.index = slots, index

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (b, n/tp, 1, d), k, v (b, g/tp, 1, d) -> (b, n/tp, 1, d): softmax over [the row's prefix, its own tokens]
        (no dropout)."""
        slots, step, i = self.slots, self.slots.step, self.index
        slots.update(i, k, v)
        b, heads, _, d = q.shape
        groups = k.shape[1]
        own_keys = slots.keys[i][:b, :, :step.end]  # (b, g/tp, E, d)
        own_values = slots.values[i][:b, :, :step.end]
        prefix_keys = slots.prefix_keys[i][:step.used, :, :step.prefix_end]  # (used, g/tp, P, d)
        prefix_values = slots.prefix_values[i][:step.used, :, :step.prefix_end]
        q = q * slots.scale
        # Each prefix's rows as one group: (used, n/tp, width, d) @ (used, n/tp, d, P), the prefix read once.
        padded = torch.cat([q[:, :, 0], q.new_zeros(1, heads, d)])  # (b + 1, n/tp, d)
        grouped = padded[step.group_rows].transpose(1, 2)  # (used, n/tp, width, d)
        prefix_scores = _per_head(_grouped(grouped, groups) @ prefix_keys.transpose(-1, -2), heads)
        prefix_scores = prefix_scores.masked_fill(~step.prefix_mask, float("-inf"))
        prefix_scores = prefix_scores[step.group_of, :, step.index_in_group]  # (b, n/tp, P)
        if step.prefix_window is not None:
            prefix_scores = prefix_scores.masked_fill(~step.prefix_window, float("-inf"))
        own_scores = _per_head(_grouped(q, groups) @ own_keys.transpose(-1, -2), heads)  # (b, n/tp, 1, E)
        own_scores = own_scores.masked_fill(~step.own_mask, float("-inf"))
        scores = torch.cat([prefix_scores[:, :, None], own_scores], dim=-1)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)  # fp32 softmax under bf16 too
        prefix_probs, own_probs = probs.split([step.prefix_end, step.end], dim=-1)
        padded = torch.cat([prefix_probs[:, :, 0], prefix_probs.new_zeros(1, heads, step.prefix_end)])
        from_prefix = _per_head(_grouped(padded[step.group_rows].transpose(1, 2), groups) @ prefix_values, heads)
        own = _per_head(_grouped(own_probs, groups) @ own_values, heads)  # (b, n/tp, 1, d)
        return from_prefix[step.group_of, :, step.index_in_group][:, :, None] + own
