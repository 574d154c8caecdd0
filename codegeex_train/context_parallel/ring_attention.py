"""Ring attention: causal attention over the whole sequence when each context-parallel rank holds two chunks of it.

Inputs are this rank's queries, keys and values (b, heads/tp, 2c, d) in the load-balanced layout of chunks.py
(CP rank r holds chunks r and 2N-1-r of the 2N). Forward, N steps: at step i rank r holds the K/V of rank
j = (r - i) mod N. Before computing the step's block it posts the exchange for step i+1 (its K/V to rank r+1, rank
r-1's into a new buffer), computes, then waits, so the transfer hides behind the block. The block (``ring_block``):

    j == r   all 2c queries x all 2c keys, causal (chunk order is global order, so the plain causal mask is right)
    j <  r   all 2c queries x the first c keys (chunk j: before both of ours; chunk 2N-1-j is after both)
    j >  r   the second c queries (chunk 2N-1-r) x all 2c keys (both of j's chunks are before it, after chunk r)

so after step 0 every rank computes 2c x c scores per step: the same work on every rank. Each block gives its output
and the log-sum-exp of its score rows; blocks merge in fp32 (out = out·e^(lse - new) + blk·e^(blk_lse - new),
new = logaddexp(lse, blk_lse)). Saved for backward: the local q, k, v, out and lse only, never a received K/V.

Backward, N steps again: K/V go round the ring as in forward, and with them a travelling dK/dV buffer of the block
held. At each step a rank computes the block's dq (kept) and its dK/dV contribution, adds the buffer received from
rank r-1 (the contributions of the ranks that held that K/V before) and passes it on with the next step's exchange;
after the last step the buffers make one more hop, to their owner. With the saved merged lse the block's
probabilities are final: P = exp(S·scale - lse), D = rowsum(dO ∘ O), dS = P ∘ (dP - D).

Attention dropout draws one keep mask per block, in step order, from the tracker's model-parallel stream; backward
replays the same draws from the stream's state at forward start (masks are never stored). Exact because
out = Σ_b e^(lse_b - lse)·drop(P_b)·V_b with lse_b from the undropped scores.

Grouped-query attention: K/V hold g key-value groups for the n query heads (query head j uses group j // (n/g)); the
ring passes the groups only (n/g times less traffic) and each block runs with the queries viewed as (b, g, n/g, lq, d)
against K/V (b, g, 1, lk, d), the group's dK/dV summed over its query heads.

Sliding window (``window`` W: query i sees keys i - W < j <= i of the global sequence): each block's mask comes from
the global positions of its query and key chunks (``window_mask``), replacing the causal flag; a block with no
visible pair is skipped in forward and backward alike (decided on the host from the positions: no device sync).
Rows of a block that see none of its keys get zero probabilities there (their log-sum-exp is -inf, and the merge
leaves the running result as it was); the own block always holds the diagonal, so no row ends empty.

Traffic (``ring_attention_bytes``, ``heads`` = the key-value groups): all through ``dist.batch_isend_irecv`` on the
CP group, which the accounting's CommCounter counts (its sends). At CP 1 (``cp_group`` None or of one rank) this is
today's ``F.scaled_dot_product_attention(is_causal=True)``, untouched (``sdpa``: with groups or a window).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from codegeex_train.context_parallel.chunks import context_parallel_indices
from codegeex_train.tensor_parallel import MODEL_PARALLEL_RNG, RNGStatesTracker
from codegeex_train.tensor_parallel.mappings import ProcessGroup, group_size

_KV, _DKV = 0, 1  # point-to-point tags: with N = 2 both streams travel between the same two ranks


class RingBytes(NamedTuple):
    forward: int
    backward: int


def ring_attention_bytes(b: int, heads: int, local_len: int, d: int, cp_size: int, dtype_bytes: int) -> RingBytes:
    """Bytes one CP rank sends in one ring attention: forward N-1 hops of its (K, V), backward N-1 hops of (K, V)
    and N of (dK, dV) (the last one back to the owner); all in the input dtype. Zero at CP 1. ``heads``: the K/V
    heads this rank holds (its key-value groups under GQA)."""
    if cp_size == 1:
        return RingBytes(0, 0)
    kv = 2 * b * heads * local_len * d * dtype_bytes
    return RingBytes(forward=(cp_size - 1) * kv, backward=(cp_size - 1) * kv + cp_size * kv)


class Block(NamedTuple):
    """The rows of the local queries and the columns of the held keys one ring step computes."""
    q: slice
    k: slice
    causal: bool


def ring_block(cp_rank: int, kv_rank: int, local_len: int, balanced: bool = True) -> Block | None:
    """What CP rank ``cp_rank`` computes while it holds rank ``kv_rank``'s keys (None: nothing). ``balanced=False``
    is the contiguous layout (rank r holds positions [r·2c, (r+1)·2c)), kept to show what balancing buys."""
    everything = slice(0, local_len)
    if kv_rank == cp_rank:
        return Block(everything, everything, True)
    if not balanced:
        return Block(everything, everything, False) if kv_rank < cp_rank else None
    c = local_len // 2
    if kv_rank < cp_rank:
        return Block(everything, slice(0, c), False)
    return Block(slice(c, local_len), everything, False)


class _Ring:
    """This rank's place on the CP ring; peers as global ranks (what point-to-point takes)."""

    def __init__(self, group: ProcessGroup):
        ranks = dist.get_process_group_ranks(group)
        self.group, self.size, self.rank = group, len(ranks), dist.get_rank(group)
        self.next, self.prev = ranks[(self.rank + 1) % self.size], ranks[(self.rank - 1) % self.size]

    def post(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]) -> list:
        """Send each (tensor, tag) to the next rank, receive each (buffer, tag) from the previous one; returns the
        works to wait on before a buffer is read or a sent tensor reused."""
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag) for t, tag in sends]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group, tag) for t, tag in recvs]
        return dist.batch_isend_irecv(ops) if ops else []  # looked up per call: the CommCounter wraps it


def _wait(works: list) -> None:
    for work in works:
        work.wait()


def _dropout_keep(q: torch.Tensor, k: torch.Tensor, dropout_p: float) -> torch.Tensor | None:
    """The keep mask (b, n, lq, lk) of the block of queries ``q`` and keys ``k``, drawn from the default stream (the
    model-parallel one inside its fork); None without dropout."""
    if dropout_p == 0.0:
        return None
    return torch.rand(q.shape[:-1] + k.shape[-2:-1], device=q.device) >= dropout_p


def _stream(tracker: RNGStatesTracker | None, replay_from: torch.Tensor | None):
    """Where dropout draws come from: the tracker's model-parallel stream (forward: advances it), or a replay of it
    from ``replay_from`` (backward: the tracker is left as it is)."""
    if tracker is None:
        return contextlib.nullcontext()
    if replay_from is None:
        return tracker.fork(MODEL_PARALLEL_RNG)
    replay = RNGStatesTracker(tracker.device)
    replay.set_states({MODEL_PARALLEL_RNG: replay_from})
    return replay.fork(MODEL_PARALLEL_RNG)


def window_mask(q_positions: torch.Tensor, k_positions: torch.Tensor, window: int) -> torch.Tensor:
    """(lq,) and (lk,) global positions -> (lq, lk) bool, True where the query sees the key under a sliding window
    of ``window`` (Hugging Face's sliding_window): q - window < k <= q."""
    offset = q_positions[:, None] - k_positions[None, :]
    return (offset >= 0) & (offset < window)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
         dropout_p: float = 0.0) -> torch.Tensor:
    """F.scaled_dot_product_attention, causal when ``mask`` is None: q (b, n, lq, d) over k, v (b, g, lk, d), g
    dividing n (query head j uses group j // (n/g)). Groups on the causal path go to SDPA as they are (enable_gqa:
    the flash kernels read each group once); with a mask K/V are first repeated to the query heads, so that a masked
    call keeps the memory-efficient kernel, which (unlike flash and math) has not taken enable_gqa."""
    attend = {"is_causal": True} if mask is None else {"attn_mask": mask}
    if k.shape[1] != q.shape[1]:
        if mask is None:
            attend["enable_gqa"] = True
        else:
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, **attend)


class _Window:
    """The sliding window over the ring: every CP rank's global positions, on the host (which blocks to skip) and
    on the device (each block's mask)."""

    def __init__(self, window: int, ring_size: int, local_len: int, balanced: bool, device: torch.device):
        s = ring_size * local_len
        held = [context_parallel_indices(s, r, ring_size) if balanced else torch.arange(r * local_len,
                                                                                           (r + 1) * local_len)
                for r in range(ring_size)]
        self.window, self.host, self.device = window, held, [p.to(device) for p in held]

    def mask(self, block: Block, rank: int, kv_rank: int) -> torch.Tensor | None:
        """The block's (lq, lk) mask, or None when no query of it sees any of its keys (the block is skipped)."""
        q, k = self.host[rank][block.q], self.host[kv_rank][block.k]  # ascending on every rank
        newest = torch.searchsorted(k, q, right=True) - 1  # the last key at or before each query
        if not bool(((newest >= 0) & (k[newest.clamp(min=0)] > q - self.window)).any()):  # host tensors
            return None
        return window_mask(self.device[rank][block.q], self.device[kv_rank][block.k], self.window)


def _sum_to(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A K/V gradient summed over the query heads of its group (GQA); as it is otherwise."""
    return t if t.shape == like.shape else t.sum_to_size(like.shape)


def _scores(q, k, causal: bool, scale: float, mask: torch.Tensor | None = None) -> torch.Tensor:
    scores = torch.matmul(q, k.transpose(-2, -1)).float() * scale  # (b, n, lq, lk)
    if mask is not None:  # the window's, causality included
        return scores.masked_fill(~mask, float("-inf"))
    if causal:
        lq, lk = scores.shape[-2:]
        future = torch.ones(lq, lk, dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return scores


def _block_forward(q, k, v, causal: bool, scale: float, keep: torch.Tensor | None, dropout_p: float,
                   mask: torch.Tensor | None = None):
    """One block: its output (b, n, lq, d) and score-row log-sum-exp (b, n, lq), both fp32."""
    scores = _scores(q, k, causal, scale, mask)
    lse = torch.logsumexp(scores, dim=-1)
    if mask is None:
        probs = torch.exp(scores - lse.unsqueeze(-1))
    else:  # a row that sees no key here: probabilities 0 (not exp(-inf + inf)), its lse stays -inf
        probs = torch.exp(scores - lse.masked_fill(lse == float("-inf"), 0.0).unsqueeze(-1))
    if keep is not None:
        probs = probs * keep / (1.0 - dropout_p)
    return torch.matmul(probs.to(v.dtype), v).float(), lse


def _merge(out, lse, block_out, block_lse):
    """Two partial attentions of the same query rows -> their combination (fp32)."""
    new = torch.logaddexp(lse, block_lse)
    out = out * torch.exp(lse - new).unsqueeze(-1) + block_out * torch.exp(block_lse - new).unsqueeze(-1)
    return out, new


def _block_backward(q, k, v, dout, lse, delta, causal: bool, scale: float, keep: torch.Tensor | None,
                    dropout_p: float, mask: torch.Tensor | None = None):
    """One block's dq, dk, dv (fp32) from the merged row ``lse`` and ``delta`` = rowsum(dout ∘ out)."""
    q, k, v, dout = q.float(), k.float(), v.float(), dout.float()
    probs = torch.exp(_scores(q, k, causal, scale, mask) - lse.unsqueeze(-1))  # final probabilities of these entries
    dprobs = torch.matmul(dout, v.transpose(-2, -1))
    if keep is not None:
        dropped = probs * keep / (1.0 - dropout_p)
        dprobs = dprobs * keep / (1.0 - dropout_p)
    else:
        dropped = probs
    dv = torch.matmul(dropped.transpose(-2, -1), dout)
    dscores = probs * (dprobs - delta.unsqueeze(-1)) * scale
    return torch.matmul(dscores, k), _sum_to(torch.matmul(dscores.transpose(-2, -1), q), k), _sum_to(dv, v)


class _RingAttention(torch.autograd.Function):
    """Forward: N ring steps of K/V, blocks merged by log-sum-exp. Backward: K/V round again with dK/dV."""

    @staticmethod
    def forward(ctx, q, k, v, ring: _Ring, dropout_p: float, tracker: RNGStatesTracker | None, balanced: bool,
                window: int | None):
        local_len, scale = q.shape[-2], q.shape[-1] ** -0.5
        rng_state = tracker.get_states()[MODEL_PARALLEL_RNG] if dropout_p > 0.0 else None
        sliding = None if window is None else _Window(window, ring.size, local_len, balanced, q.device)
        kv = torch.stack([k, v])  # (2, b, n, 2c, d): one buffer per hop
        out = lse = None
        with _stream(tracker if dropout_p > 0.0 else None, None):
            for step in range(ring.size):
                incoming, works = None, []
                if step + 1 < ring.size:
                    incoming = torch.empty_like(kv)
                    works = ring.post([(kv, _KV)], [(incoming, _KV)])
                block, mask = _planned(ring, step, local_len, balanced, sliding)
                if block is not None:
                    qb, kb, vb = q[..., block.q, :], kv[0][..., block.k, :], kv[1][..., block.k, :]
                    keep = _dropout_keep(qb, kb, dropout_p)
                    block_out, block_lse = _block_forward(qb, kb, vb, block.causal, scale, keep, dropout_p, mask)
                    if out is None:  # step 0: the own block covers every row
                        out, lse = block_out, block_lse
                    else:
                        out[..., block.q, :], lse[..., block.q] = _merge(out[..., block.q, :], lse[..., block.q],
                                                                         block_out, block_lse)
                _wait(works)
                kv = incoming
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.dropout_p, ctx.balanced, ctx.sliding = ring, dropout_p, balanced, sliding
        ctx.tracker, ctx.rng_state = (tracker, rng_state) if dropout_p > 0.0 else (None, None)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, dropout_p = ctx.ring, ctx.dropout_p
        local_len, scale = q.shape[-2], q.shape[-1] ** -0.5
        delta = (dout.float() * out.float()).sum(-1)  # (b, n, 2c)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        dkv = None  # dK/dV of the K/V held, summed over the ranks that held it before
        with _stream(ctx.tracker, ctx.rng_state):
            for step in range(ring.size):
                sends, recvs, incoming, dkv_in = [], [], None, None
                if step + 1 < ring.size:
                    incoming = torch.empty_like(kv)
                    sends.append((kv, _KV))
                    recvs.append((incoming, _KV))
                if step > 0:  # the previous step's sum goes on with the K/V it belongs to
                    dkv_in = torch.empty_like(kv)
                    sends.append((dkv, _DKV))
                    recvs.append((dkv_in, _DKV))
                works = ring.post(sends, recvs)
                contribution = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
                block, mask = _planned(ring, step, local_len, ctx.balanced, ctx.sliding)
                if block is not None:
                    qb, kb, vb = q[..., block.q, :], kv[0][..., block.k, :], kv[1][..., block.k, :]
                    keep = _dropout_keep(qb, kb, dropout_p)  # the forward's draw of this block, replayed
                    dqb, dkb, dvb = _block_backward(qb, kb, vb, dout[..., block.q, :], lse[..., block.q],
                                                    delta[..., block.q], block.causal, scale, keep, dropout_p, mask)
                    dq[..., block.q, :] += dqb
                    contribution[0][..., block.k, :] += dkb
                    contribution[1][..., block.k, :] += dvb
                _wait(works)
                dkv = (contribution if dkv_in is None else contribution + dkv_in.float()).to(kv.dtype)
                kv = incoming
        own = torch.empty_like(dkv)
        _wait(ring.post([(dkv, _DKV)], [(own, _DKV)]))  # the last hop: each sum to the rank whose K/V it is
        return dq.to(q.dtype), own[0], own[1], None, None, None, None, None


def _planned(ring: _Ring, step: int, local_len: int, balanced: bool,
             sliding: _Window | None) -> tuple[Block | None, torch.Tensor | None]:
    """The block of ``step`` (``ring_block``) and, under a sliding window, its mask (None, None: nothing to do)."""
    kv_rank = (ring.rank - step) % ring.size
    block = ring_block(ring.rank, kv_rank, local_len, balanced)
    if block is None or sliding is None:
        return block, None
    mask = sliding.mask(block, ring.rank, kv_rank)
    return (None, None) if mask is None else (block, mask)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp_group: ProcessGroup | None, *,
                   dropout_p: float = 0.0, rng_tracker: RNGStatesTracker | None = None,
                   balanced: bool = True, window: int | None = None) -> torch.Tensor:
    """Causal attention over the global sequence: q (b, heads/tp, 2c, d) and k, v (b, groups/tp, 2c, d) (groups =
    heads without GQA) this CP rank's two chunks -> (b, heads/tp, 2c, d). ``dropout_p`` > 0 (training) draws from
    ``rng_tracker``'s model-parallel stream, which should differ per CP rank. ``balanced=False``: the contiguous
    layout, for tests that show what it costs. ``window``: sliding-window attention (--window-size)."""
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:] or q.shape[1] % k.shape[1]:
        raise ValueError(f"ring attention needs q (b, heads, 2c, d) and k, v (b, groups, 2c, d) with the groups "
                         f"dividing the heads: got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if window is not None and window >= q.shape[2] * group_size(cp_group):
        window = None  # it spans the whole sequence: plain causal attention
    if group_size(cp_group) == 1:  # today's path, unchanged (with groups or a window: their masks)
        s = q.shape[2]
        mask = None if window is None else window_mask(*(torch.arange(s, device=q.device),) * 2, window)
        if dropout_p > 0.0 and rng_tracker is not None:
            with rng_tracker.fork():
                return sdpa(q, k, v, mask, dropout_p)
        return sdpa(q, k, v, mask, dropout_p)
    if balanced and q.shape[2] % 2:
        raise ValueError(f"a context-parallel rank holds 2 equal chunks: local length {q.shape[2]} is odd")
    if dropout_p > 0.0 and rng_tracker is None:
        raise ValueError("attention dropout under context parallelism needs the model-parallel RNG tracker")
    if q.shape[1] != k.shape[1]:  # GQA: each group's query heads as one more batch dimension
        q, k, v = q.unflatten(1, (k.shape[1], -1)), k.unsqueeze(2), v.unsqueeze(2)  # (b, g, n/g, 2c, d), (b, g, 1, ..)
        return _RingAttention.apply(q, k, v, _Ring(cp_group), dropout_p, rng_tracker, balanced, window).flatten(1, 2)
    return _RingAttention.apply(q, k, v, _Ring(cp_group), dropout_p, rng_tracker, balanced, window)
