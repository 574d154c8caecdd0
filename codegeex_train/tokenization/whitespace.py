"""CodeGeeX's whitespace encoding: a run of 2..N spaces becomes one extra token.

Indentation then costs one token per run instead of several. A run longer than N is split
into chunks of N; a leftover single space stays ordinary text (it precedes the next text),
so decoding every run back to spaces restores the exact input.
"""

import re

WHITESPACE_START_EXTRA_ID = 10
"""CodeGeeX maps a run of 2 spaces to `<|extratoken_10|>`, 3 to `_11`, ..., 10 to `_18`."""
DEFAULT_MAX_WHITESPACE_RUN = 10
"""Longest run that gets its own token (CodeGeeX's choice: covers 8-space indents + a little)."""

_SPACE_RUN = re.compile(r" {2,}")


def whitespace_token(run_length: int) -> str:
    """The extra token standing for `run_length` (>= 2) consecutive spaces."""
    if run_length < 2:
        raise ValueError(f"whitespace runs start at 2 spaces, got {run_length}")
    return f"<|extratoken_{WHITESPACE_START_EXTRA_ID + run_length - 2}|>"


def whitespace_tokens(max_run: int = DEFAULT_MAX_WHITESPACE_RUN) -> list[str]:
    """Extra tokens for runs of 2..max_run spaces, shortest first."""
    return [whitespace_token(n) for n in range(2, max_run + 1)]


def split_whitespace_runs(text: str, max_run: int = DEFAULT_MAX_WHITESPACE_RUN) -> list[str | int]:
    """Split text into text pieces (str) and space runs (int lengths, each 2..max_run).

    Joining the pieces, with each int n read as n spaces, gives back `text`.
    """
    if max_run < 2:
        raise ValueError(f"max whitespace run must be >= 2, got {max_run}")
    parts: list[str | int] = []
    pending = ""  # text not yet emitted, incl. a leftover single space from the last run
    pos = 0
    for match in _SPACE_RUN.finditer(text):
        pending += text[pos : match.start()]
        if pending:
            parts.append(pending)
            pending = ""
        full, rest = divmod(match.end() - match.start(), max_run)
        parts.extend([max_run] * full)
        if rest >= 2:
            parts.append(rest)
        elif rest == 1:
            pending = " "
        pos = match.end()
    pending += text[pos:]
    if pending:
        parts.append(pending)
    return parts
