"""Choosing the next token from full-vocabulary logits: greedy, temperature, top-k, top-p.

The order is Hugging Face's (``generate``'s logits warpers): divide by the temperature, keep the top k,
then the smallest set of most likely tokens whose probability reaches top_p, and sample from what is
left. Ties with the last token a filter keeps are kept too (a row's kept set never depends on how a sort orders
equal values). Temperature 0 is greedy (argmax; the lowest id among ties) and ignores top-k and top-p.

**The draw** is an inverse CDF: one uniform u in [0, 1) per row, and the token is the first id (in vocabulary
order) at which the cumulative probability of the kept tokens exceeds u times their total. So a row's token is a
function of its logits and its u alone, whatever else is in the batch: the generator gives every sample its own
stream of u's (``row_seed``: one ``torch.Generator`` per sample, one draw per new token; ``batching.py``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from codegeex_train.config.options import option


@dataclass
class SamplingParams:
    """How to decode. ``stop``: a completion ends before the first occurrence of any of these strings.

    Its fields are the sampling flags of every command that generates (tools/generate.py, tools/evaluate_humaneval.py:
    ``config.options.add_config_flags``), declared here once."""

    max_new_tokens: int = option(128, "tokens to generate at most")
    temperature: float = option(0.0, "sampling temperature; 0 = greedy")
    top_k: int = option(0, "sample among the k most likely tokens (0 = off)")
    top_p: float = option(1.0, "sample within the smallest set of tokens whose probability reaches p (1 = off)")
    seed: int = option(1234, "prompt i's sample j draws from a random stream seeded by (seed, i, j): the same "
                       "completions on a rerun, whatever --batch-size")
    stop: tuple[str, ...] = ()

    FLAGS = ("max_new_tokens", "temperature", "top_k", "top_p", "seed")  # (stop: tools/generate.py's, with escapes)

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


# Most nuclei at code models' temperatures hold a few dozen tokens: the first look is at this many candidates (a
# partial top-k, ~15x cheaper than sorting a row of 8k-50k); a row whose nucleus is wider is sorted whole.
NUCLEUS_CANDIDATES = 64


def _nucleus_floor(descending: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(floor, found) for rows of probabilities sorted in descending order: floor = the probability at the first
    place where their running sum reaches p; found = whether it does within these columns."""
    reached = descending.cumsum(dim=-1) >= p
    found = reached.any(dim=-1)
    first = torch.where(found, reached.to(torch.int8).argmax(dim=-1), descending.shape[-1] - 1)
    return descending.gather(-1, first[:, None]).squeeze(-1), found


def _sorted_descending(rows: torch.Tensor) -> torch.Tensor:
    """Each row's values in descending order (on CPU by numpy, whose sort is ~7x torch's there)."""
    if rows.device.type == "cpu":
        return torch.from_numpy(np.ascontiguousarray(np.sort(rows.numpy(), axis=-1)[:, ::-1]))
    return torch.sort(rows, dim=-1, descending=True).values


def top_p_mask(scores: torch.Tensor, p: float) -> torch.Tensor:
    """True for the tokens outside the nucleus: the fewest most likely tokens whose probability sums to at least
    ``p``, and every token as likely as the least likely of them (ties are kept, as in ``top_k_mask``; the most
    likely token always is). A row's nucleus depends on that row alone: the candidates a row is looked at through
    (a partial top-k, then a full sort for a row whose nucleus is wider) give the same floor."""
    probs = torch.softmax(scores, dim=-1)
    k = min(NUCLEUS_CANDIDATES, probs.shape[-1])
    floor, found = _nucleus_floor(torch.topk(probs, k, dim=-1).values, p)
    wide = (~found).nonzero().flatten()
    if len(wide) and k < probs.shape[-1]:
        floor[wide] = _nucleus_floor(_sorted_descending(probs[wide]), p)[0]
    return probs < floor[:, None]  # a row whose probabilities never reach p (rounding): all kept


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
    takes the first id whose cumulative kept probability exceeds ``uniforms[i]`` (in [0, 1)) times the total.

    The running sum only needs the kept ids (in id order): they are gathered first, as many columns as the widest
    row keeps, a shorter row padded with probability 0. Adding 0.0 leaves a float64 sum exactly
    as it was, so every row's token is the one the running sum over its whole vocabulary gives."""
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = torch.softmax(filtered_scores(logits, params), dim=-1)
    row, kept_id = (probs > 0).nonzero(as_tuple=True)  # row by row, ids ascending
    counts = torch.bincount(row, minlength=probs.shape[0])
    width = int(counts.max())
    place = torch.arange(len(row), device=row.device) - (counts.cumsum(0) - counts)[row]  # index within the row
    ids = torch.zeros(probs.shape[0], width, dtype=torch.long, device=probs.device)
    ids[row, place] = kept_id
    probs = probs.new_zeros(ids.shape).index_put_((row, place), probs[row, kept_id])  # (b, width), 0 padded
    cdf = probs.double().cumsum(dim=-1)  # float64: the targets near 1 must not fall past the last kept id
    target = uniforms.to(device=cdf.device, dtype=torch.float64) * cdf[:, -1]
    chosen = torch.searchsorted(cdf, target[:, None], right=True).squeeze(-1)
    # u * total can round up to total itself: take the last id with probability > 0 instead
    last_kept = width - 1 - (probs.flip(-1) > 0).to(torch.int8).argmax(dim=-1)
    return ids.gather(-1, torch.minimum(chosen, last_kept)[:, None]).squeeze(-1)


def sample_next_tokens(logits: torch.Tensor, params: SamplingParams,
                       generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token of each row of ``logits`` (b, v): (b,) int64, one uniform per row from ``generator``."""
    if params.greedy:
        return logits.argmax(dim=-1)
    device = generator.device if generator is not None else torch.device("cpu")
    return choose_tokens(logits, params, torch.rand(logits.shape[0], generator=generator, dtype=torch.float64,
                                                    device=device))
