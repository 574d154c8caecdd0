"""Completion text: stop strings and CodeGeeX's whitespace tokens."""

from __future__ import annotations

import re

from codegeex_train.tokenization.whitespace import DEFAULT_MAX_WHITESPACE_RUN, WHITESPACE_START_EXTRA_ID

HUMANEVAL_STOP = ("\ndef", "\nclass", "\nif", "\nprint", "\n#")
"""HumanEval's stop strings (Codex paper; CodeGeeX's evaluation): a completed function body ends before them."""

_WHITESPACE_TOKEN = re.compile(r"<\|extratoken_(\d+)\|>")


def truncate_at_stop(text: str, stop: tuple[str, ...] | list[str]) -> str:
    """``text`` up to (not including) the earliest occurrence of any stop string; all of it if none occurs."""
    found = [i for i in (text.find(s) for s in stop) if i != -1]
    return text[:min(found)] if found else text


def decode_whitespace_tokens(text: str, max_run: int = DEFAULT_MAX_WHITESPACE_RUN) -> str:
    """Spell CodeGeeX's whitespace tokens (``<|extratoken_10|>`` = 2 spaces ... ``<|extratoken_18|>`` = 10)
    as the spaces they stand for: what CodeGeeX's own decoder does to text from a tokenizer that prints
    them literally (one loaded without ``--whitespace-encoding``). Other extra tokens are left alone."""
    def spaces(match: re.Match) -> str:
        n = int(match.group(1)) - WHITESPACE_START_EXTRA_ID + 2
        return " " * n if 2 <= n <= max_run else match.group(0)

    return _WHITESPACE_TOKEN.sub(spaces, text)
