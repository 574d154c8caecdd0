"""Choosing the next token from full-vocabulary logits: greedy, temperature, top-k, top-p.

The order is Hugging Face's (``generate``'s logits warpers): divide by the temperature, keep the top k,
then the smallest set of most likely tokens whose probability reaches top_p, and sample from what is
left. Temperature 0 is greedy (argmax; the lowest id among ties) and ignores top-k and top-p.

**The draw** is an inverse CDF: one uniform u in [0, 1) per row, and the token is the first id (in vocabulary
order) at which the cumulative probability of the kept tokens exceeds u times their total. So a row's token is a
function of its logits and its u alone, whatever else is in the batch: the generator gives every sample its own
stream of u's (``row_seed``: one ``torch.Generator`` per sample, one draw per new token; ``batching.py``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch


@dataclass
class SamplingParams:
    """How to decode. ``stop``: a completion ends before the first occurrence of any of these strings."""

    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int = 1234
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self.stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        problems = []
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            problems.append(f"max_new_tokens={self.max_new_tokens!r} (--max-new-tokens): must be an integer >= 0")
        if not self.temperature >= 0.0:  # also catches NaN
            problems.append(f"temperature={self.temperature!r} (--temperature): must be >= 0 (0 = greedy)")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            problems.append(f"top_k={self.top_k!r} (--top-k): must be an integer >= 0 (0 = off)")
        if not 0.0 < self.top_p <= 1.0:
            problems.append(f"top_p={self.top_p!r} (--top-p): must be in (0, 1] (1 = off)")
        if not all(isinstance(s, str) and s for s in self.stop):
            problems.append(f"stop={self.stop!r} (--stop): stop strings must be non-empty strings")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def top_k_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """True for the tokens outside the k highest scores of each row (ties with the k-th are kept)."""
    k = min(k, scores.shape[-1])
    kth = torch.topk(scores, k, dim=-1).values[..., -1:]
    return scores < kth


def top_p_mask(scores: torch.Tensor, p: float) -> torch.Tensor:
    """True for the tokens outside the nucleus: the smallest set of most likely tokens whose probability
    sums to at least ``p`` (the most likely token is always kept)."""
    sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
    probs = torch.softmax(sorted_scores, dim=-1)
    before = probs.cumsum(dim=-1) - probs  # probability of the more likely tokens
    remove_sorted = before >= p
    remove_sorted[..., 0] = False
    return torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)


def filtered_scores(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits / temperature with the tokens top-k and top-p exclude set to -inf (params not greedy)."""
    scores = logits.float() / params.temperature
    if params.top_k > 0:
        scores = scores.masked_fill(top_k_mask(scores, params.top_k), float("-inf"))
    if params.top_p < 1.0:
        scores = scores.masked_fill(top_p_mask(scores, params.top_p), float("-inf"))
    return scores


def row_seed(seed: int, prompt: int, sample: int) -> int:
    """The seed of the random stream of sample ``sample`` of prompt ``prompt`` in a call seeded ``seed``: the first
    8 bytes of SHA-256("seed:prompt:sample"), as a non-negative int64. Distinct seeds give unrelated streams (no
    ``seed + i`` overlaps between calls)."""
    digest = hashlib.sha256(f"{int(seed)}:{int(prompt)}:{int(sample)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def choose_tokens(logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor | None) -> torch.Tensor:
    """The next token of each row of ``logits`` (b, v): (b,) int64. Greedy ignores ``uniforms``; otherwise row i
    takes the first id whose cumulative kept probability exceeds ``uniforms[i]`` (in [0, 1)) times the total."""
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = torch.softmax(filtered_scores(logits, params), dim=-1)
    cdf = probs.double().cumsum(dim=-1)  # float64: the targets near 1 must not fall past the last kept id
    target = uniforms.to(device=cdf.device, dtype=torch.float64) * cdf[:, -1]
    chosen = torch.searchsorted(cdf, target[:, None], right=True).squeeze(-1)
    # u * total can round up to total itself: take the last id with probability > 0 instead
    last_kept = probs.shape[-1] - 1 - (probs.flip(-1) > 0).to(torch.int8).argmax(dim=-1)
    return torch.minimum(chosen, last_kept)


def sample_next_tokens(logits: torch.Tensor, params: SamplingParams,
                       generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token of each row of ``logits`` (b, v): (b,) int64, one uniform per row from ``generator``."""
    if params.greedy:
        return logits.argmax(dim=-1)
    device = generator.device if generator is not None else torch.device("cpu")
    return choose_tokens(logits, params, torch.rand(logits.shape[0], generator=generator, dtype=torch.float64,
                                                    device=device))
