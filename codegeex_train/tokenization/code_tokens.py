"""The sentinel tokens of code data: fill-in-the-middle and repository documents, one table for every tokenizer.

StarCoder's names (``<fim_prefix>``, ``<fim_middle>``, ``<fim_suffix>``, ``<fim_pad>``, ``<repo_name>``,
``<file_sep>``) are the sentinels' identity; StarCoder's and StarCoder2's tokenizers hold them under these names. A
code model family that spells them its own way (``FAMILY_SENTINELS``) is recognised by its spelling of
``<fim_prefix>`` and keeps its ids:

    Qwen2.5-Coder    <|fim_prefix|> <|fim_middle|> <|fim_suffix|> <|fim_pad|> <|repo_name|> <|file_sep|>
    DeepSeek-Coder   <｜fim▁begin｜> (prefix), <｜fim▁end｜> (middle), <｜fim▁hole｜> (suffix); no pad, repository
                     or file tokens: StarCoder's names are appended for those
    CodeGeeX         its unused <|extratoken_1..6|> (its whitespace runs use 10..18), so the released 13B
                     model's embedding needs no new rows

Any other tokenizer gets the missing ones appended as special tokens, in ``SENTINELS`` order, so preprocessing,
training and generation that start from the same tokenizer file agree on the ids whatever feature asked first.

The layouts (the FIM paper, Bavarian et al. 2022, as StarCoder and Megatron's FIM dataset write them; the families
above train PSM in the same layout under their own names)::

    PSM: <fim_prefix> prefix <fim_suffix> suffix <fim_middle> middle
    SPM: <fim_prefix> <fim_suffix> suffix <fim_middle> prefix middle

The model learns to emit the middle after ``<fim_middle>`` and to end it with EOD (the document's own end).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

SENTINELS = ("<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<repo_name>", "<file_sep>")
CODEGEEX_SENTINELS = {name: f"<|extratoken_{i}|>" for i, name in enumerate(SENTINELS, start=1)}
# Each family's spelling of the sentinels it has, by StarCoder's name; the first one whose <fim_prefix> a tokenizer
# holds names its sentinels.
FAMILY_SENTINELS = {
    "codegeex": CODEGEEX_SENTINELS,
    "qwen2.5-coder": {name: "<|" + name.strip("<>") + "|>" for name in SENTINELS},
    "deepseek-coder": {"<fim_prefix>": "<\uff5cfim\u2581begin\uff5c>", "<fim_middle>": "<\uff5cfim\u2581end\uff5c>",
                       "<fim_suffix>": "<\uff5cfim\u2581hole\uff5c>"},
}
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


def sentinel_family(tokenizer: Extensible) -> str | None:
    """The family (a ``FAMILY_SENTINELS`` key) whose sentinels ``tokenizer`` holds, or None (StarCoder's names)."""
    return next((family for family, names in FAMILY_SENTINELS.items()
                 if _token_to_id(tokenizer, names[SENTINELS[0]]) is not None), None)


def _names(tokenizer: Extensible) -> list[str]:
    """The sentinels' names in ``tokenizer``'s vocabulary: its family's where it has one, else StarCoder's."""
    family = FAMILY_SENTINELS.get(sentinel_family(tokenizer), {})
    return [family.get(s, s) for s in SENTINELS]


def holds_fim_sentinels(tokenizer: Extensible) -> bool:
    """Whether ``tokenizer`` already holds the three FIM sentinels (prefix, middle, suffix) in its family's names:
    a model trained with them infills (its pad, repository and file tokens may still be missing)."""
    return all(_token_to_id(tokenizer, name) is not None for name in _names(tokenizer)[:3])


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
