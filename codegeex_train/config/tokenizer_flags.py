"""The tokenizer flags, declared once: their spellings, defaults and help are ``TokenizerFlags``'s fields.

Training's ``DataConfig`` lists them among its own (``tokenizer_field``); every tool that builds a tokenizer
generates its flags from them (``options.add_config_flags``: tools/preprocess_data.py, generate.py,
evaluate_humaneval.py, convert_checkpoint.py), giving its own default where its meaning differs. Apart from
arguments.py so that a tool reads them without importing what training needs (torch).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from codegeex_train.config.options import option
from codegeex_train.tokenization.tokenizer import TOKENIZER_TYPES

__all__ = ["TOKENIZER_TYPES", "TokenizerFlags", "tokenizer_field"]


@dataclass
class TokenizerFlags:
    """The tokenizer a run trains with (``tokenization.load_tokenizer`` builds it from these)."""

    tokenizer_type: str | None = option(None, "HFTokenizer, GPT2BPETokenizer, SentencePieceTokenizer or "
                                        "CodeGeeXTokenizer (CodeGeeX-13B's: GPT-2 + 143 extra tokens = 50400 ids, "
                                        "whitespace encoding built in; pad with --make-vocab-size-divisible-by "
                                        "52224) (default: the shipped tokenizer trained on the Python stdlib)",
                                        choices=TOKENIZER_TYPES)
    tokenizer_model: str | None = option(None, "tokenizer.json (HFTokenizer), .model (SentencePiece), or a Hugging "
                                         "Face tokenizer directory holding one (CodeGeeXTokenizer: e.g. a local "
                                         "copy of EleutherAI/gpt-j-6B's tokenizer files)")
    vocab_file: str | None = option(None, "GPT-2 vocab.json (GPT2BPETokenizer, CodeGeeXTokenizer)")
    merge_file: str | None = option(None, "GPT-2 merges.txt (GPT2BPETokenizer, CodeGeeXTokenizer)")
    whitespace_encoding: bool = option(False, "CodeGeeX's whitespace tokens for runs of spaces (always on with "
                                       "CodeGeeXTokenizer)")


_DECLARED = {f.name: f for f in dataclasses.fields(TokenizerFlags)}


def tokenizer_field(name: str) -> Any:
    """A field declared as ``TokenizerFlags``'s ``name`` (its default and flag metadata), for a config section that
    lists the tokenizer flags among its own (``DataConfig``: a field object belongs to one class, so each gets its
    own)."""
    declared = _DECLARED[name]
    return dataclasses.field(default=declared.default, metadata=declared.metadata)
