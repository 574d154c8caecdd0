"""The sentinel tokens of code data: fill-in-the-middle and repository documents, one table for every tokenizer.

StarCoder's names (``<fim_prefix>``, ``<fim_middle>``, ``<fim_suffix>``, ``<fim_pad>``, ``<repo_name>``,
``<file_sep>``) are the sentinels' identity. A tokenizer that already holds them (StarCoder's own) keeps its ids;
CodeGeeX's tokenizer maps them onto its unused ``<|extratoken_N|>`` ids (1..6; its whitespace runs use 10..18),
so the released 13B model's embedding needs no new rows; any other tokenizer gets the missing ones appended
as special tokens, all six at once and in this order, so preprocessing, training and generation that start
from the same tokenizer file agree on the ids whatever feature asked first.

The layouts (the FIM paper, Bavarian et al. 2022, as StarCoder and Megatron's FIM dataset write them)::

    PSM: <fim_prefix> prefix <fim_suffix> suffix <fim_middle> middle
    SPM: <fim_prefix> <fim_suffix> suffix <fim_middle> prefix middle

The model learns to emit the middle after ``<fim_middle>`` and to end it with EOD (the document's own end).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

SENTINELS = ("<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<repo_name>", "<file_sep>")
CODEGEEX_SENTINELS = {name: f"<|extratoken_{i}|>" for i, name in enumerate(SENTINELS, start=1)}
FIM_ORDERS = ("psm", "spm")


class Extensible(Protocol):
    """What this module needs of a tokenizer (tokenizer.py's ``Tokenizer``, which imports this module to make the
    sentinels special: named by its protocol, not imported back)."""

    def add_tokens(self, tokens: list[str]) -> list[int]: ...


@dataclass(frozen=True)
class CodeTokens:
    """The sentinels' ids in one tokenizer."""

    fim_prefix: int
    fim_middle: int
    fim_suffix: int
    fim_pad: int
    repo_name: int
    file_sep: int


def _token_to_id(tokenizer: Extensible, token: str) -> int | None:
    inner = getattr(tokenizer, "inner", tokenizer)  # WhitespaceEncodingTokenizer wraps the vocabulary's owner
    hf = getattr(inner, "_tokenizer", None)
    if hf is not None and hasattr(hf, "token_to_id"):
        return hf.token_to_id(token)
    return getattr(inner, "_added", {}).get(token)


def _names(tokenizer: Extensible) -> list[str]:
    """The sentinels' names in ``tokenizer``'s vocabulary: CodeGeeX's (GPT-J's) extra tokens, else StarCoder's."""
    if _token_to_id(tokenizer, CODEGEEX_SENTINELS[SENTINELS[0]]) is not None:
        return [CODEGEEX_SENTINELS[s] for s in SENTINELS]
    return list(SENTINELS)


def held_code_tokens(tokenizer: Extensible) -> CodeTokens | None:
    """The sentinels' ids in ``tokenizer``, or None when it lacks any of them; adds nothing (a run's tokenizer got
    them from ``load_tokenizer`` under --fim-rate)."""
    ids = [_token_to_id(tokenizer, name) for name in _names(tokenizer)]
    return None if any(i is None for i in ids) else CodeTokens(*ids)


def code_tokens(tokenizer: Extensible) -> CodeTokens:
    """The sentinels' ids in ``tokenizer``, appending the missing ones (all six, in ``SENTINELS`` order) first.

    Idempotent: a second call returns the same ids and grows nothing."""
    held = held_code_tokens(tokenizer)
    if held is not None:
        return held
    tokenizer.add_tokens(_names(tokenizer))
    return held_code_tokens(tokenizer)


def trained_order(fim_spm_rate: float) -> str:
    """The order to prompt a model trained at ``fim_spm_rate`` in: the one it saw most, PSM on a tie (StarCoder's
    default at 0.5, where the model learnt both)."""
    return "spm" if fim_spm_rate > 0.5 else "psm"


def fim_layout(order: str, prefix: list[int], middle: list[int], suffix: list[int], tokens: CodeTokens) -> list[int]:
    """One FIM example's ids in ``order`` ('psm' or 'spm'), the middle included (training)."""
    return fim_prompt(order, prefix, suffix, tokens) + middle


def fim_prompt(order: str, prefix: list[int], suffix: list[int], tokens: CodeTokens) -> list[int]:
    """What the model reads before it writes the middle (inference): the layout up to ``<fim_middle>``, and in
    SPM the prefix after it (there the middle continues the prefix)."""
    if order == "psm":
        return [tokens.fim_prefix, *prefix, tokens.fim_suffix, *suffix, tokens.fim_middle]
    if order == "spm":
        return [tokens.fim_prefix, tokens.fim_suffix, *suffix, tokens.fim_middle, *prefix]
    raise ValueError(f"FIM order {order!r}: expected one of {', '.join(FIM_ORDERS)}")
