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

RoPE scaling (--rope-scaling, ``RopeScaling``), as the model families extend their context; each changes the inverse
frequencies theta_i only, so everything above (KV cache, CP, recompute) is unchanged. Formulas as Hugging Face's
``ROPE_INIT_FUNCTIONS`` compute them in fp32 (the tests compare the tables):
  - linear: theta_i / factor (positions interpolated by the factor);
  - llama3 (Llama 3.1): with L the original context, wavelengths 2 pi / theta_i above L / low_freq_factor are divided
    by the factor, those below L / high_freq_factor kept, those between blended by
    t = (L / wavelength - low) / (high - low): (1 - t) theta / factor + t theta;
  - yarn (YaRN): theta_i = interp_i (1 - e_i) + extrap_i e_i with interp = theta / factor, extrap = theta and e_i =
    1 - ramp(i), the ramp linear from 0 to 1 between the channel pairs that turn beta_fast and beta_slow times over
    L (their bounds floored / ceiled, clipped to [0, r - 1]); cos and sin are multiplied by the attention factor
    (default 0.1 ln(factor) + 1), which scales every attention logit by its square.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from codegeex_train.config.model_config import ModelConfig


class RopeScaling(NamedTuple):
    """--rope-scaling and its parameters (the config's rope_* and yarn_* fields)."""

    kind: str  # linear | llama3 | yarn
    factor: float
    original_max_positions: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None

    @classmethod
    def of(cls, config: ModelConfig) -> "RopeScaling | None":
        """The config's scaling, or None (--rope-scaling none: the plain tables, unchanged)."""
        if config.rope_scaling == "none":
            return None
        return cls(config.rope_scaling, config.rope_scaling_factor, config.rope_original_max_position_embeddings,
                   config.rope_low_freq_factor, config.rope_high_freq_factor, config.yarn_beta_fast,
                   config.yarn_beta_slow, config.yarn_attention_factor)

    @property
    def cos_sin_factor(self) -> float:
        """What cos and sin are multiplied by: YaRN's attention factor, 1 otherwise."""
        if self.kind != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        return 1.0 if self.factor <= 1 else 0.1 * math.log(self.factor) + 1.0


def inverse_frequencies(rotary_dim: int, base: int, device: torch.device | str | None = None) -> torch.Tensor:
    """theta_i = base^(-2i / rotary_dim) for i < rotary_dim / 2, fp32 (rotary_dim / 2,)."""
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim))


def scaled_inverse_frequencies(rotary_dim: int, base: int, scaling: RopeScaling,
                               device: torch.device | str | None = None) -> torch.Tensor:
    """theta_i under ``scaling`` (the module docstring's formulas), fp32 (rotary_dim / 2,)."""
    theta = inverse_frequencies(rotary_dim, base, device)
    if scaling.kind == "linear":
        return theta / scaling.factor
    if scaling.kind == "llama3":
        return _llama3(theta, scaling)
    if scaling.kind == "yarn":
        return _yarn(rotary_dim, base, scaling, device)
    raise ValueError(f"--rope-scaling {scaling.kind}: not one of linear, llama3, yarn")


def _llama3(theta: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    length, factor = scaling.original_max_positions, scaling.factor
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    wavelength = 2 * math.pi / theta
    long = wavelength > length / low  # low frequencies: interpolated
    short = wavelength < length / high  # high frequencies: kept
    theta = torch.where(long, theta / factor, theta)
    t = (length / wavelength - low) / (high - low)
    blended = (1 - t) * theta / factor + t * theta
    return torch.where(~short & ~long, blended, theta)


def _yarn(rotary_dim: int, base: int, scaling: RopeScaling, device: torch.device | str | None) -> torch.Tensor:
    length, factor = scaling.original_max_positions, scaling.factor

    def pair_turning(rotations: float) -> float:  # the (fractional) channel pair that turns ``rotations`` times over L
        return rotary_dim * math.log(length / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(pair_turning(scaling.beta_fast)), 0)
    high = min(math.ceil(pair_turning(scaling.beta_slow)), rotary_dim - 1)
    if low == high:
        high += 0.001  # a one-pair ramp
    wavelengths = base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim)
    extrapolated, interpolated = 1.0 / wavelengths, 1.0 / (factor * wavelengths)
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the pair keeps its frequency (fast pairs), 0: interpolated (slow pairs)
    return interpolated * (1 - keep) + extrapolated * keep


def rotary_tables(position_ids: torch.Tensor, rotary_dim: int, base: int, dtype: torch.dtype,
                  scaling: RopeScaling | None = None) -> torch.Tensor:
    """(b, s) int positions -> (2, b, s, 1, rotary_dim / 2): cos and sin of position x theta_i (angles in fp32), in
    ``dtype``; the 1 broadcasts over heads. ``scaling``: --rope-scaling's theta_i and cos / sin factor."""
    if scaling is None:
        angles = position_ids[..., None].float() * inverse_frequencies(rotary_dim, base, position_ids.device)
        return torch.stack((angles.cos(), angles.sin())).unsqueeze(-2).to(dtype)  # (2, b, s, 1, r/2)
    theta = scaled_inverse_frequencies(rotary_dim, base, scaling, position_ids.device)
    angles = position_ids[..., None].float() * theta
    tables = torch.stack((angles.cos(), angles.sin()))
    if scaling.cos_sin_factor != 1.0:
        tables = tables * scaling.cos_sin_factor
    return tables.unsqueeze(-2).to(dtype)  # (2, b, s, 1, r/2)


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
