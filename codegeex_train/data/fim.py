"""Fill-in-the-middle on the stored tokens, as training reads them (Megatron's --fim-* flags, BigCode's scheme).

A packed sample (``seq_length + 1`` ids) is cut at every EOD into segments (documents, the first and last usually
partial). Each non-empty segment independently, with probability ``rate``, is detokenized to text, cut at two
points drawn uniformly over its characters (``integers(0, len + 1, size=2)``, sorted: any part may be empty),
and its prefix, middle and suffix are re-tokenized separately and laid out (``code_tokens.fim_layout``), in SPM
order with probability ``spm_rate``, else PSM::

    PSM: <fim_prefix> prefix <fim_suffix> suffix <fim_middle> middle
    SPM: <fim_prefix> <fim_suffix> suffix <fim_middle> prefix middle

With ``split_sample`` (a token id, e.g. ``<file_sep>`` of repository documents), a segment holding it is chosen
with probability ``rate`` and then each of its fragments between split tokens with ``fragment_rate`` (Megatron's
rule: a fragment's own rate is ``rate * fragment_rate``); a segment without it is treated as above. The EODs and
split tokens stay where they were; empty segments and fragments stay empty (Megatron drops the EOD or split token
after an empty one and turns a trailing empty segment into three sentinels: we do neither).

Length: the sentinels and the re-tokenized cut points make a transformed sample longer; as BigCode's fork does,
the whole sample is truncated to its original length (the tail of the last segments is lost), or, when it came out
shorter, padded at the end with ``<fim_pad>``. Padding carries no loss: ``FIMDataset`` returns a ``loss_mask``
(float, one per label ``text[1:]``) that is 0 where the label is ``<fim_pad>``.

Whitespace survives exactly: the cut points are character positions of the decoded text, so a cut inside a run
of spaces leaves the two shorter runs on either side, and with CodeGeeX's whitespace encoding each re-encodes as
its own run token(s) (a run of 6 cut at 2 -> ``<2 spaces>`` | ``<4 spaces>``; a lone space left by a cut is an
ordinary BPE token); byte-level BPE decodes and encodes every other character exactly. Prefix + middle + suffix
is always the segment's text, character for character; only the tokens next to the cut points differ from the
stored ones (a word or run cut in two is two tokens). A tokenizer whose round trip is not exact (SentencePiece
that normalises whitespace) changes the text as Megatron's would.

Left as stored, so that no corrupted text is trained on: a segment holding a sentinel (``<repo_name>``, ...: its
text would re-encode as plain text, special tokens in text being text here) and one whose decode is lossy (a
sample edge cutting a multi-byte character: U+FFFD in the text and no exact re-encoding). Megatron transforms both.

Determinism: sample i's choices come from a generator seeded by (``seed``, i) alone (``sample_rng``), never from
a stream drawn in access order as Megatron's is; so a resumed run, another DP/TP/PP layout and any number of
loader workers read the same tokens for sample i.

Only the training split is transformed (``gpt_dataset``): validation and test stay left-to-right, so their loss
is the same measure whatever --fim-rate a run uses and runs with and without FIM compare on it. (Megatron's
``GPTFIMDataset`` is the dataset class of all three splits; its validation loss mixes in FIM examples.)
"""

from __future__ import annotations

from dataclasses import astuple, dataclass
from functools import cached_property
from typing import Callable

import numpy as np
import torch

from codegeex_train.tokenization.code_tokens import SENTINELS, CodeTokens, _token_to_id, fim_layout, held_code_tokens
from codegeex_train.tokenization.tokenizer import Tokenizer

__all__ = ["FIM", "FIMDataset", "fim_from_flags", "sample_rng"]

FIM_STREAM = 0x46494D  # "FIM": keeps these generators apart from any other seeded by (seed, i)


def sample_rng(seed: int, index: int) -> np.random.Generator:
    """The generator of sample ``index``'s FIM choices: a function of (seed, index) only."""
    return np.random.default_rng((FIM_STREAM, seed, index))


def _each_piece(tokens: np.ndarray, separator: int, transform: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """``tokens`` with ``transform`` applied to each piece between ``separator`` ids, the separators kept."""
    out, start = [], 0
    for end in np.flatnonzero(tokens == separator):
        out += [transform(tokens[start:end]), tokens[end:end + 1]]
        start = end + 1
    out.append(transform(tokens[start:]))
    return np.concatenate(out)


@dataclass(frozen=True)
class FIM:
    """The FIM transform of one run: its tokenizer, sentinels and rates."""

    tokenizer: Tokenizer
    tokens: CodeTokens
    rate: float
    spm_rate: float = 0.5
    split_sample: int | None = None
    fragment_rate: float | None = None  # None: ``rate``

    def apply(self, sample: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """``sample`` (int ids) transformed segment by segment, then truncated or ``<fim_pad>``-padded to its
        length."""
        out = _each_piece(sample, self.tokenizer.eod, lambda seg: self._segment(seg, rng))
        if len(out) >= len(sample):
            return out[:len(sample)]
        return np.concatenate([out, np.full(len(sample) - len(out), self.tokens.fim_pad, dtype=out.dtype)])

    def _segment(self, segment: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        if self.split_sample is None or not (segment == self.split_sample).any():
            return self._permute(segment, self.rate, rng)
        if rng.random() >= self.rate:
            return segment
        rate = self.rate if self.fragment_rate is None else self.fragment_rate
        return _each_piece(segment, self.split_sample, lambda fragment: self._permute(fragment, rate, rng))

    def _permute(self, tokens: np.ndarray, rate: float, rng: np.random.Generator) -> np.ndarray:
        """One document (or fragment) as a FIM example with probability ``rate``, else as it is."""
        if not tokens.size or rng.random() >= rate:
            return tokens
        ids = tokens.tolist()
        if not set(ids).isdisjoint(self._sentinels):
            return tokens
        text = self.tokenizer.decode(ids)
        if not text or ("\ufffd" in text and self.tokenizer.encode(text) != ids):
            return tokens
        lo, hi = sorted(rng.integers(0, len(text) + 1, size=2).tolist())
        prefix, middle, suffix = self.tokenizer.encode_batch([text[:lo], text[lo:hi], text[hi:]])
        order = "spm" if rng.random() < self.spm_rate else "psm"
        return np.asarray(fim_layout(order, prefix, middle, suffix, self.tokens), dtype=tokens.dtype)

    @cached_property
    def _sentinels(self) -> frozenset[int]:
        return frozenset(astuple(self.tokens))


def _split_token(flags, tokenizer: Tokenizer, tokens: CodeTokens) -> int | None:
    """--fim-split-sample's id: a sentinel's name (``<file_sep>``), a vocabulary entry, or text that encodes to
    exactly one id."""
    name = flags.fim_split_sample
    if name is None:
        return None
    if name in SENTINELS:
        found = getattr(tokens, name.strip("<>"))
    else:
        found = _token_to_id(tokenizer, name)
        if found is None:
            ids = tokenizer.encode(name)
            found = ids[0] if len(ids) == 1 else None
    if found is None:
        raise ValueError(f"--fim-split-sample {name!r} is not one token of the tokenizer: give one of its tokens, "
                         f"e.g. <file_sep> (the file separator of repository documents)")
    if found in (tokenizer.eod, tokens.fim_prefix, tokens.fim_middle, tokens.fim_suffix, tokens.fim_pad):
        raise ValueError(f"--fim-split-sample {name!r} is EOD or a FIM sentinel (id {found}): give the token that "
                         f"separates files inside a document, e.g. <file_sep>")
    return found


def fim_from_flags(flags, tokenizer: Tokenizer) -> FIM | None:
    """The FIM transform ``flags`` ask for (``DataConfig``'s ``fim_rate``, ``fim_spm_rate``, ``fim_split_sample``,
    ``fim_fragment_rate``), None at --fim-rate 0. ``tokenizer`` is the run's (``load_tokenizer(flags)``, which
    added the sentinels: the one place they are added); ValueError naming the flag when --fim-split-sample is not
    one token of it. pretrain.py builds it once, before any process group, and hands it to the datasets."""
    if not flags.fim_rate:
        return None
    tokens = held_code_tokens(tokenizer)
    if tokens is None:
        raise ValueError("--fim-rate: the tokenizer lacks the FIM sentinels (load it with load_tokenizer of the "
                         "same flags, which adds them)")
    return FIM(tokenizer, tokens, flags.fim_rate, flags.fim_spm_rate, _split_token(flags, tokenizer, tokens),
               flags.fim_fragment_rate)


class FIMDataset(torch.utils.data.Dataset):
    """``dataset``'s sample i with ``fim`` applied, its choices drawn from ``sample_rng(seed, i)``.

    Items are ``{"text": (seq_length + 1,) int64, "loss_mask": (seq_length,) float32}``: the mask is 0 where the
    label (``text[1:]``) is ``<fim_pad>``, the padding of a sample that came out shorter."""

    def __init__(self, dataset: torch.utils.data.Dataset, fim: FIM, seed: int) -> None:
        self.dataset, self.fim, self.seed = dataset, fim, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        text = self.fim.apply(self.dataset[i]["text"], sample_rng(self.seed, int(i)))
        return {"text": text, "loss_mask": (text[1:] != self.fim.tokens.fim_pad).astype(np.float32)}
