"""Rotary position embeddings (RoPE), as Megatron-LM applies them (--position-embedding-type rope).

Channel pair (a, b) of each head's query and key turns by position x theta_i, theta_i = base^(-2i / r), where r =
int(head_dim x --rotary-percent) channels rotate (the first r of the head; the rest pass through unchanged):

    a' = a cos - b sin,   b' = b cos + a sin

so q_m . k_n depends on the positions through m - n only. The pairs: (i, i + r/2) by default (GPT-NeoX's and
Llama's "rotate half" layout, Megatron's default), (2i, 2i + 1) with --rotary-interleaved (GPT-J's). Angles are
computed in fp32 from the position ids and their cos / sin cast to the dtype of q and k (as Megatron and Hugging
Face do). The positions are the batch's position ids (b, s), not 0..s-1: packed samples with --reset-position-ids
restart at each document, a KV-cache decoding step passes the positions of its new tokens, and a context-parallel
rank passes the global positions of its sequence chunks.

The model computes the (cos, sin) tables once per forward of a stage (or model chunk) and every attention reads them
(an input of ``checkpoint`` under full recompute). The rotation runs after the QKV projection and before core
attention, so selective recompute of ``core_attn`` keeps the rotated q, k, v as before. Activation memory is that of
learned positions plus the tables (b x s x rotary_dim elements per forward, in the activations' dtype): the rotation
keeps only the tables for its backward, and the attention copies v beside the new q and k, so that no view keeps
the fused QKV output alive (measured: otherwise 2 b s h/tp more per attention).

CodeGeeX's top query layer under RoPE: its queries come from a learned table indexed by position (query i asks
"which token comes at i + 1?"). Under RoPE that table has ONE row, the query's content, the same at every
position, and the position enters as in every other layer, through the rotation of the query and of the keys; query
i then attends by key content and relative offset. Why: a table with a row per position is what RoPE removes: it
would grow with the sequence (32K positions x hidden 5120 = 168M parameters, replicated on every TP rank), cap the
length at --max-position-embeddings like learned positions do, and leave the rows beyond the trained length
untrained when the context is extended; a rotated single query has none of these, keeps the layer's parameters
and work per token, and needs nothing new from KV-cache decoding or context parallelism.
"""

from __future__ import annotations

import torch


def inverse_frequencies(rotary_dim: int, base: int, device: torch.device | str | None = None) -> torch.Tensor:
    """theta_i = base^(-2i / rotary_dim) for i < rotary_dim / 2, fp32 (rotary_dim / 2,)."""
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim))


def rotary_tables(position_ids: torch.Tensor, rotary_dim: int, base: int, dtype: torch.dtype) -> torch.Tensor:
    """(b, s) int positions -> (2, b, s, 1, rotary_dim / 2): cos and sin of position x theta_i (angles in fp32), in
    ``dtype``; the 1 broadcasts over heads."""
    angles = position_ids[..., None].float() * inverse_frequencies(rotary_dim, base, position_ids.device)
    return torch.stack((angles.cos(), angles.sin())).unsqueeze(-2).to(dtype)  # (2, b, s, 1, r/2)


def apply_rotary(x: torch.Tensor, tables: torch.Tensor, head_dim: int, interleaved: bool = False) -> torch.Tensor:
    """Rotate the first rotary_dim channels of every head of ``x`` (b, s, heads * head_dim) by ``tables``
    (``rotary_tables``); returns a new (b, s, heads * head_dim) tensor."""
    b, s, _ = x.shape
    cos, sin = tables  # (b, s, 1, r/2) each
    r = 2 * cos.shape[-1]
    heads = x.view(b, s, -1, head_dim)  # (b, s, n, d); also a view of a slice of the fused QKV output
    rot = heads[..., :r]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)  # (b, s, n, r)
    else:
        x1, x2 = rot[..., :r // 2], rot[..., r // 2:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)  # (b, s, n, r)
    if r < head_dim:
        out = torch.cat((out, heads[..., r:]), dim=-1)
    return out.reshape(b, s, -1)  # (b, s, n * d)
