"""Causal self-attention split by heads, and the top query layer's attention (queries from positions).

Each TP rank owns heads/tp heads: the fused projection is column-parallel with ``stride`` blocks, so the
FULL weight keeps GPT-2's [Q; K; V] block layout while rank r holds [Q_r; K_r; V_r] (its heads' rows of
each block). The output projection is row-parallel: one all-reduce forward, and the f inside the
column-parallel input gives the one all-reduce backward.

Grouped-query attention (--group-query-attention --num-query-groups g): n query heads share g key-value groups,
query head j using group j // (n/g) (Hugging Face's repeat_kv order). The fused weight is [Q (n·d rows); K (g·d);
V (g·d)] and is split in blocks of (n, g, g) (stride (n, g, g)), so TP rank r holds its n/tp query heads and the
g/tp groups they use: the groups never cross a rank (TP must divide g: layout/plan.py's kv_groups_per_tp_rank).
Core attention takes the g/tp groups as they are (SDPA's enable_gqa on the causal path; with a mask, K/V repeated to
the heads first: context_parallel/ring_attention.py's ``sdpa`` says why), the KV cache and the ring hold groups
only. The top query layer stays multi-head. --disable-bias-linear drops the output projection's bias (and the
projections' unless --add-qkv-bias).

Sliding-window attention (--window-size W, Hugging Face's sliding_window): query i sees keys i - W < j <= i only
(sequence indices, not position ids). Training builds one (1, 1, s, s) band mask per forward
(``training_attention_mask``, anded with document masking's when there is one) that every attention reads like the
document mask (a window of s or more leaves the causal path as it is); under CP the ring builds each block's part from
global positions and skips blocks outside the window; the KV cache and KVSlots mask cached keys older than W (they
still hold every position: a rolling buffer of W would bound their memory).

Incremental decoding (codegeex_train/generation) passes a ``KVCache`` slot to each attention: the keys and
values of this step's tokens are written into it and the queries attend over every cached position. Without
a cache (training, evaluation) the code path is the one above, unchanged.

Sequence parallelism changes only the ends: the projections' inputs arrive split along the sequence and are
all-gathered, the output projection reduce-scatters; the heads in between see the whole sequence. Selective
recompute of ``core_attn`` keeps the queries, keys and values and re-runs the attention itself in backward (with
the forward's dropout masks: ``checkpoint`` restores the RNG streams).

RoPE (--position-embedding-type rope, model/rotary.py): ``rotary`` (2, b, s, 1, r/2), the forward's cos and sin
tables, rotates each head's queries and keys right after the projections, before core attention (and before a KV
cache stores the keys: cached keys are rotated by their own positions).

Context parallelism (--context-parallel-size): each CP rank holds two chunks of every sequence (context_parallel/
chunks.py) and attention runs as ring attention over the CP group (context_parallel/ring_attention.py): the same
causal softmax over the whole sequence, K/V passed round the ring. The projections, RoPE (with each token's global
position) and everything else see the rank's own tokens only. Decoding and document masking run without CP.

Document masking (--reset-attention-mask): packed samples hold several documents and a token attends to the
earlier tokens of its own document only. The batch carries document ids (b, s) int; the model turns them into one
(b, 1, s, s) bool block-causal mask per forward (``document_attention_mask``), shared by every attention of the
stage (the top query layer's too) and passed to SDPA as ``attn_mask`` (an input of ``checkpoint`` under recompute,
saved by reference, never rebuilt). What it costs, against the ``is_causal`` path that runs when no document ids are
given (unchanged: same kernel, same numbers):
  - memory: b·s² bytes for the mask per forward of a stage (or model chunk) (s = 2048, b = 4: 16 MiB), kept
    while that micro-batch's activations are; SDPA converts a bool mask to an additive one of the query's dtype inside the
    call (b·s² elements more, transient), and the CPU math path also keeps the (b, n/tp, s, s) probabilities that
    the flash path never stores;
  - speed: on GPU an ``attn_mask`` leaves the flash kernel out (it takes causal masks only): SDPA picks the
    memory-efficient kernel (no s x s probabilities, but slower than flash, more so on long sequences) or the math
    path where that kernel does not apply. On CPU (torch 2.13, b 2, 8 heads, s 1024, d 64) forward + backward took
    299 ms with the mask against 186 ms causal. FlexAttention with a block mask would skip the masked blocks, but
    it needs torch.compile to be fast and has no backward on CPU in torch 2.13; it is not used.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from codegeex_train.config.model_config import ModelConfig
from codegeex_train.context_parallel.ring_attention import ring_attention, sdpa, window_mask
from codegeex_train.layout.plan import ParallelPlan, kv_groups_per_tp_rank
from codegeex_train.model.groups import ModelGroups
from codegeex_train.model.init import ParamInit
from codegeex_train.model.rotary import apply_rotary
from codegeex_train.tensor_parallel import (
    ColumnParallelLinear,
    RNGStatesTracker,
    RowParallelLinear,
    divide,
    recompute_activations,
)
from codegeex_train.tensor_parallel.mappings import ProcessGroup, group_size


def _split_heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    b, s, _ = x.shape
    return x.view(b, s, -1, head_dim).transpose(1, 2)  # (b, heads/tp, s, d)


def kv_heads_of(num_attentions: int, groups_per_partition: int, heads_per_partition: int,
                top_query_layer: bool) -> list[int]:
    """The key-value heads this rank caches for each attention of a stage: its layers' groups, then (the top query
    layer, multi-head) its heads."""
    return [groups_per_partition] * (num_attentions - top_query_layer) + [heads_per_partition] * top_query_layer


class KVCache:
    """Keys and values of every attention of a model stage (its layers in order, then the top query layer)
    for the tokens seen so far, for incremental decoding.

    Buffers are allocated once: per attention, keys and values (b, kv heads/tp, capacity, d), this rank's key-value
    groups only (``kv_heads``: a count per attention, or one for all; ``kv_heads_of``: the top query layer, multi-head,
    caches its heads), and ``valid`` (b, capacity): which cached positions hold real tokens (False: left padding).
    ``length`` positions are filled. A forward with the cache calls ``begin`` (s new positions and their
    padding; builds the one mask every attention uses), each attention writes its new keys and values
    with ``update`` and attends over positions 0 .. length + s - 1, and ``commit`` then advances ``length``.
    ``window``: --window-size (keys more than W - 1 positions back are masked).
    """

    def __init__(self, num_attentions: int, batch_size: int, capacity: int, kv_heads: int | list[int], head_dim: int,
                 *, window: int | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None):
        heads = [kv_heads] * num_attentions if isinstance(kv_heads, int) else list(kv_heads)
        if len(heads) != num_attentions:
            raise ValueError(f"kv_heads: {len(heads)} counts for {num_attentions} attentions")
        self.keys = [torch.zeros(batch_size, n, capacity, head_dim, dtype=dtype, device=device) for n in heads]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.valid = torch.zeros(batch_size, capacity, dtype=torch.bool, device=device)
        self.capacity, self.length, self.new, self.window = capacity, 0, 0, window
        self.padded = False  # any invalid position cached: every later step needs a mask
        self.mask: torch.Tensor | None = None  # (b, 1, s, length + s) bool for the forward in flight, or None

    def begin(self, seq_len: int, padding_mask: torch.Tensor | None = None) -> None:
        """Start a forward over ``seq_len`` new positions; ``padding_mask`` (b, s) bool marks real tokens."""
        start, end = self.length, self.length + seq_len
        if end > self.capacity:
            raise ValueError(f"KV cache holds {self.capacity} positions; {self.length} cached + {seq_len} new")
        if padding_mask is None:
            self.valid[:, start:end] = True
        else:
            self.valid[:, start:end] = padding_mask
            self.padded = self.padded or not bool(padding_mask.all())
        self.new = seq_len
        if seq_len == 1 and not self.padded and (self.window is None or end <= self.window):
            self.mask = None  # one query, every cached key visible
            return
        # Query i (absolute position start + i) sees keys j <= start + i that are real tokens (and within the
        # window). A padding query also sees itself, so that no softmax row is empty (its output is never attended to).
        q_pos = torch.arange(start, end, device=self.valid.device)[:, None]
        k_pos = torch.arange(end, device=self.valid.device)[None, :]
        mask = (k_pos <= q_pos) & self.valid[:, None, :end]  # (b, s, end)
        if self.window is not None:
            mask = mask & (k_pos > q_pos - self.window)
        self.mask = (mask | (k_pos == q_pos)).unsqueeze(1)  # (b, 1, s, end)

    def update(self, index: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write attention ``index``'s new keys and values (b, kv heads/tp, s, d); return all so far."""
        end = self.length + self.new
        self.keys[index][:, :, self.length:end] = k
        self.values[index][:, :, self.length:end] = v
        return self.keys[index][:, :, :end], self.values[index][:, :, :end]

    def commit(self) -> None:
        self.length += self.new
        self.new, self.mask = 0, None

    def slot(self, index: int) -> "KVCacheSlot":
        return KVCacheSlot(self, index)


class KVCacheSlot:
    """One attention's view of a KVCache."""

    def __init__(self, cache: KVCache, index: int):
        self.cache, self.index = cache, index

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store k, v (b, g/tp, s, d); attend q (b, n/tp, s, d) over every cached position (no dropout)."""
        k, v = self.cache.update(self.index, k, v)
        if k.shape[1] != q.shape[1]:  # groups: SDPA reads each cached group once for its heads
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self.cache.mask, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.cache.mask)


def document_attention_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """(b, s) document index of each token -> (b, 1, s, s) bool, True where query i may attend to key j: j <= i and
    both in the same document (the block-causal mask of --reset-attention-mask; the diagonal is always True, so no
    softmax row is empty)."""
    s = document_ids.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=document_ids.device).tril()  # (s, s)
    same = document_ids[:, :, None] == document_ids[:, None, :]  # (b, s, s)
    return (same & causal).unsqueeze(1)  # (b, 1, s, s), broadcast over heads


def training_attention_mask(document_ids: torch.Tensor | None, seq_len: int, window: int | None,
                            device: torch.device | str | None = None) -> tuple[torch.Tensor, ...]:
    """() (the plain causal path) or the one bool mask every attention of a training forward reads: document
    masking's (b, 1, s, s), the sliding window's (1, 1, s, s) band, or both anded. ``window``: --window-size, None
    under CP (the ring masks its blocks itself); one of s or more changes nothing (the causal path stays)."""
    mask = None if document_ids is None else document_attention_mask(document_ids)
    if window is not None and window < seq_len:
        positions = torch.arange(seq_len, device=device if document_ids is None else document_ids.device)
        band = window_mask(positions, positions, window)[None, None]  # (1, 1, s, s)
        mask = band if mask is None else mask & band
    return () if mask is None else (mask,)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int, dropout_p: float,
                     rng_tracker: RNGStatesTracker | None, cache: KVCacheSlot | None = None,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + causal) v on (b, s, heads/tp * d) q and (b, s, groups/tp * d) k, v inputs ->
    (b, s, heads/tp * d).

    ``mask`` (b | 1, 1, s, s) bool (True: attend): document masking's block-causal mask and / or the sliding window's
    band (``training_attention_mask``) instead of the plain causal one. With ``cache``: q, k, v are the new
    positions'; keys and values are appended to the cache and the queries attend over everything cached (decoding,
    dropout off)."""
    q, k, v = (_split_heads(t, head_dim) for t in (q, k, v))  # (b, n/tp, s, d); k, v (b, g/tp, s, d)
    if cache is not None:
        ctx = cache.attend(q, k, v)
    elif dropout_p > 0.0 and rng_tracker is not None:
        # The probabilities belong to this rank's heads only: draw the mask from the TP-rank stream,
        # or every rank would repeat the same mask on different heads.
        with rng_tracker.fork():
            ctx = sdpa(q, k, v, mask, dropout_p)
    else:
        ctx = sdpa(q, k, v, mask, dropout_p)
    b, _, s, _ = ctx.shape
    return ctx.transpose(1, 2).reshape(b, s, -1)  # (b, s, h/tp)


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int, dropout_p: float,
                               rng_tracker: RNGStatesTracker | None, cp_group: ProcessGroup,
                               window: int | None = None) -> torch.Tensor:
    """``causal_attention`` over the whole sequence when this rank holds its CP share (two chunks, context_parallel/
    chunks.py): ring attention over ``cp_group`` (sliding ``window``: from the chunks' global positions).
    (b, 2c, heads/tp * d) q, (b, 2c, groups/tp * d) k, v -> (b, 2c, heads/tp * d)."""
    q, k, v = (_split_heads(t, head_dim) for t in (q, k, v))  # (b, n/tp, 2c, d); k, v (b, g/tp, 2c, d)
    ctx = ring_attention(q, k, v, cp_group, dropout_p=dropout_p, rng_tracker=rng_tracker, window=window)
    b, _, s, _ = ctx.shape
    return ctx.transpose(1, 2).reshape(b, s, -1)  # (b, 2c, h/tp)


def core_attention(q, k, v, head_dim: int, dropout_p: float, rng_tracker: RNGStatesTracker | None,
                   cache: KVCacheSlot | None, recompute: bool, mask: torch.Tensor | None = None,
                   cp_group: ProcessGroup | None = None, window: int | None = None) -> torch.Tensor:
    """``causal_attention`` (ring attention over ``cp_group``, given under context parallelism only), re-run in
    backward instead of kept when ``recompute`` (training with grad only); the mask is one of the recomputed
    function's inputs. ``window`` (--window-size): the ring masks by it; without CP the mask must hold the band
    (``training_attention_mask``) and a KV cache masks by its own."""
    if cache is not None and mask is not None:
        raise ValueError("a KV cache builds its own mask: document masking is for training")
    if cp_group is not None:
        if cache is not None or mask is not None:
            raise ValueError("context parallelism is for training without document masking: no KV cache, no mask")
        attend_cp = lambda q_, k_, v_: context_parallel_attention(q_, k_, v_, head_dim, dropout_p,  # noqa: E731
                                                                  rng_tracker, cp_group, window)
        if recompute and torch.is_grad_enabled():  # the forward ring runs again in backward
            return recompute_activations(attend_cp, rng_tracker, q, k, v)
        return attend_cp(q, k, v)
    if window is not None and window < q.shape[1] and cache is None and mask is None:
        raise ValueError(f"--window-size {window}: the attention needs the band mask (model/attention.py's "
                         f"training_attention_mask), or it would see the whole causal prefix")
    if recompute and cache is None and torch.is_grad_enabled():
        def attend(q_, k_, v_, *mask_):
            return causal_attention(q_, k_, v_, head_dim, dropout_p, rng_tracker, mask=mask_[0] if mask_ else None)

        return recompute_activations(attend, rng_tracker, q, k, v, *(() if mask is None else (mask,)))
    return causal_attention(q, k, v, head_dim, dropout_p, rng_tracker, cache, mask)


class _Attention(nn.Module):
    """What both attentions share: the row-parallel output projection and, between the subclass's projections and
    it, RoPE and core attention (ring attention over ``groups.cp`` under CP). A subclass builds its projections in
    ``_projections`` (before ``dense``: the parameters' order is the state dict's) and turns its inputs into this
    rank's q, k, v (b, s, h/tp) each."""

    def __init__(self, config: ModelConfig, groups: ModelGroups, plan: ParallelPlan,
                 rng_tracker: RNGStatesTracker | None, init: ParamInit, prefix: str, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        super().__init__()
        h = config.hidden_size
        self.head_dim, self.dropout_p, self.rng_tracker = config.head_dim, config.attention_dropout, rng_tracker
        self.cp_group = groups.cp  # context parallelism: ring attention over it (None: SDPA)
        self.window = config.window_size
        self.rotary_interleaved = config.rotary_interleaved
        self.recompute_core = plan.recompute.selects("core_attn")
        self.hidden_per_partition = divide(h, groups.tp_size, "hidden size")
        linear = {"sequence_parallel": plan.sp, "dtype": dtype, "device": device}
        self._projections(config, groups.tp, init, prefix, linear)
        self.dense = RowParallelLinear(h, h, groups.tp, input_is_parallel=True, bias=config.linear_bias,
                                       init_method=init.scaled(prefix + "dense.weight"), **linear)

    def _projections(self, config: ModelConfig, tp_group: ProcessGroup | None, init: ParamInit, prefix: str,
                     linear: dict) -> None:
        raise NotImplementedError

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                cache: KVCacheSlot | None, rotary: torch.Tensor | None) -> torch.Tensor:
        """(b, s, h/tp) q, (b, s, kv channels/tp) k, v -> (b, s, h), or (b, s/tp, h) under SP."""
        if rotary is not None:  # new q, k; v copied too, so that nothing keeps the fused output alive for backward
            q, k = (apply_rotary(t, rotary, self.head_dim, self.rotary_interleaved) for t in (q, k))
            v = v.contiguous()
        p = self.dropout_p if self.training else 0.0
        ctx = core_attention(q, k, v, self.head_dim, p, self.rng_tracker, cache, self.recompute_core,
                             mask, self.cp_group, self.window)  # (b, s, h/tp)
        return self.dense(ctx)


class ParallelSelfAttention(_Attention):
    """GPT-2 attention: fused QKV column-parallel (stride 3; under GQA blocks of (heads, groups, groups)), causal
    SDPA, row-parallel output."""

    def _projections(self, config: ModelConfig, tp_group: ProcessGroup | None, init: ParamInit, prefix: str,
                     linear: dict) -> None:
        h, n, g = config.hidden_size, config.num_attention_heads, config.kv_groups
        self.kv_per_partition = kv_groups_per_tp_rank(n, g, group_size(tp_group)) * config.head_dim  # g·d/tp
        self.query_key_value = ColumnParallelLinear(h, h + 2 * config.kv_size, tp_group,
                                                    stride=3 if g == n else (n, g, g), bias=config.qkv_bias,
                                                    init_method=init.normal(prefix + "query_key_value.weight"),
                                                    **linear)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, cache: KVCacheSlot | None = None,
                rotary: torch.Tensor | None = None) -> torch.Tensor:
        """``mask``: ``training_attention_mask``'s (document masking, window), or None (causal). ``rotary``: RoPE's
        tables, or None."""
        qkv = self.query_key_value(x)  # (b, s, (n + 2g)d/tp) = [q_r | k_r | v_r]
        kv = self.kv_per_partition
        q, k, v = qkv.split([self.hidden_per_partition, kv, kv], dim=-1)  # (b, s, h/tp), 2 x (b, s, g·d/tp)
        return self._attend(q, k, v, mask, cache, rotary)


class TopQueryAttention(_Attention):
    """CodeGeeX's top query attention: keys and values from the hidden states (fused KV, stride 2),
    queries from a separate embedding of the position (query i predicts token i + 1); under RoPE from one learned
    row, rotated by the position like the keys (model/rotary.py)."""

    def _projections(self, config: ModelConfig, tp_group: ProcessGroup | None, init: ParamInit, prefix: str,
                     linear: dict) -> None:
        h, bias = config.hidden_size, config.qkv_bias  # multi-head under GQA too
        self.query = ColumnParallelLinear(h, h, tp_group, bias=bias, init_method=init.normal(prefix + "query.weight"),
                                          **linear)
        self.key_value = ColumnParallelLinear(h, 2 * h, tp_group, stride=2, bias=bias,
                                              init_method=init.normal(prefix + "key_value.weight"), **linear)

    def forward(self, x: torch.Tensor, query_embeds: torch.Tensor, mask: torch.Tensor | None = None,
                cache: KVCacheSlot | None = None, rotary: torch.Tensor | None = None) -> torch.Tensor:
        """``mask``: ``training_attention_mask``'s (document masking, window), or None (causal). ``rotary``: RoPE's
        tables, or None (the queries then carry their position in ``query_embeds``)."""
        q = self.query(query_embeds)  # (b, s, h/tp)
        k, v = self.key_value(x).split(self.hidden_per_partition, dim=-1)  # 2 x (b, s, h/tp)
        return self._attend(q, k, v, mask, cache, rotary)
