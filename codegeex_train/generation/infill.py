"""Fill-in-the-middle at inference: the order a checkpoint was trained with, its prompt, where the middle ends.

A model trained with ``--fim-rate`` above 0 read documents cut into prefix, middle and suffix, each tokenized on
its own, in one of two layouts (``codegeex_train/tokenization/code_tokens.py``)::

    PSM: <fim_prefix> prefix <fim_suffix> suffix <fim_middle> middle <EOD>
    SPM: <fim_prefix> <fim_suffix> suffix <fim_middle> prefix middle <EOD>

so to infill, it reads the layout up to the middle (``fim_prompt``) and writes the middle, which ends where the
document ended: at EOD. The sentinels never occur inside a middle, so a sentinel it emits ends the middle too
(``<fim_pad>``, ``<file_sep>`` of a repository document, ...).

**Which order.** A training checkpoint records ``fim_rate`` and ``fim_spm_rate`` beside its tokenizer settings
(``checkpoint/files.py``). With ``fim_spm_rate`` 1.0 the model only ever saw SPM, so it is prompted in SPM; with
0 only PSM; in between it saw both and either works (the FIM paper trains both jointly; StarCoder's default 0.5):
we use PSM, and ``--fim-order`` chooses. A checkpoint recording ``fim_rate`` 0 or nothing was never shown the
sentinels: infilling is refused (``InfillError``).

**Ids.** The sentinels come from ``code_tokens(tokenizer)``: CodeGeeX's tokenizer has them among its extra
tokens, any other gets them appended in a fixed order, as preprocessing and training did, so the ids agree.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from codegeex_train.tokenization.code_tokens import FIM_ORDERS, CodeTokens, code_tokens, fim_prompt, trained_order
from codegeex_train.tokenization.tokenizer import Tokenizer

DEFAULT_MARKER = "<FILL_HERE>"


class InfillError(ValueError):
    """Infilling that cannot be done as asked; the message names the flag, file or checkpoint."""


@dataclass(frozen=True)
class FimFormat:
    """How to prompt one FIM-trained model: the order and its tokenizer's sentinel ids."""

    order: str  # "psm" or "spm"
    tokens: CodeTokens

    def prompt_ids(self, tokenizer: Tokenizer, prefix: str, suffix: str) -> list[int]:
        """The ids the model reads before it writes the middle; prefix and suffix tokenized on their own, as in
        training."""
        return fim_prompt(self.order, tokenizer.encode(prefix), tokenizer.encode(suffix), self.tokens)

    @property
    def end_ids(self) -> tuple[int, ...]:
        """Ids that end a middle besides EOD (the generator's own): every sentinel."""
        t = self.tokens
        return (t.fim_pad, t.file_sep, t.fim_prefix, t.fim_suffix, t.fim_middle, t.repo_name)


def recorded_fim(meta: dict) -> tuple[float, float] | None:
    """(fim_rate, fim_spm_rate) a checkpoint's metadata records beside its tokenizer, or None when it trained
    without FIM (rate 0, or a checkpoint from before FIM was recorded: converted, or older)."""
    settings = meta.get("tokenizer")
    if not isinstance(settings, dict):
        return None
    rate, spm = settings.get("fim_rate"), settings.get("fim_spm_rate", 0.5)
    for name, value in (("fim_rate", rate), ("fim_spm_rate", spm)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)
                                  or not 0.0 <= value <= 1.0):
            raise InfillError(f"the checkpoint records {name} {str(value)[:40]!r}: expected a number in [0, 1]")
    if not rate:
        return None
    return float(rate), float(spm if spm is not None else 0.5)


def fim_tokens_if_trained(meta: dict, tokenizer: Tokenizer) -> CodeTokens | None:
    """The sentinel ids, added to ``tokenizer`` as training added them, when the checkpoint trained with FIM;
    None (``tokenizer`` untouched) otherwise. Call it before any check of the tokenizer's size against the
    model's vocabulary."""
    return code_tokens(tokenizer) if recorded_fim(meta) is not None else None


def fim_format(meta: dict, tokenizer: Tokenizer, order: str | None = None, where: str = "the checkpoint",
               flag: str = "--infill") -> FimFormat:
    """The FIM prompt format of the checkpoint whose metadata is ``meta``: its trained order unless ``order``
    is given; the sentinels added to ``tokenizer`` when missing. InfillError when it never trained with FIM."""
    fim = recorded_fim(meta)
    if fim is None:
        raise InfillError(f"{flag}: {where} was not trained with fill-in-the-middle (it records no --fim-rate above "
                          f"0), so it cannot infill: use a checkpoint trained with --fim-rate > 0, or --prompt")
    if order is not None and order not in FIM_ORDERS:
        raise InfillError(f"--fim-order {order!r}: expected one of {', '.join(FIM_ORDERS)}")
    return FimFormat(order or trained_order(fim[1]), code_tokens(tokenizer))


def split_at_marker(text: str, marker: str, where: str) -> tuple[str, str]:
    """(prefix, suffix) around the one ``marker`` in ``text``; InfillError naming ``where`` otherwise."""
    count = text.count(marker)
    if count != 1:
        found = "no" if count == 0 else f"{count}"
        raise InfillError(f"{where}: holds {found} {marker} marker{'s' if count > 1 else ''}; put exactly one where "
                          f"the middle goes (--infill-marker sets another marker)")
    prefix, suffix = text.split(marker)
    return prefix, suffix
