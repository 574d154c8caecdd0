"""Rank-aware console logging through Python's ``logging``: which rank shows what, and on which stream.

Modules log with ``logging.getLogger(__name__)`` (which puts them under ``codegeex_train``: no import of this module
needed, so every layer logs alike); an entry point (pretrain.py, a tool's ``main``) calls ``setup_logging`` once it
knows its rank and flags:

=====================  ===========================================================================================
default                rank 0 at ``--log-level`` (info) and above; every other rank warnings and errors only
``--log-all-ranks``    every rank at ``--log-level``
=====================  ===========================================================================================

A line is the bare message at info (rank 0's lines read as the prints they replaced), ``warning: ...``,
``error: ...`` or ``debug: ...`` otherwise. Lines of a rank other than 0, and every line under ``--log-all-ranks``,
start ``[rank N] `` (each line of a multi-line message, so ``grep '^\\[rank 3\\]'`` finds all of rank 3's). Info and
debug go to stdout (a tool whose stdout is its result passes ``info_stream="stderr"``), warnings and errors to
stderr; the stream is looked up at each line, so a redirection made later (``contextlib.redirect_stdout``, a
test's capture) sees it. Lines go through ``tqdm.write``, so an active progress bar is redrawn below them.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

from tqdm import tqdm

ROOT = "codegeex_train"
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def level_name(text: str) -> str:
    """A ``--log-level`` value as a key of ``LEVELS``: a name in any case, or Megatron's number (``--logging-level
    20`` is logging's INFO); anything else is returned for the parser's choices to refuse."""
    numbers = {str(number): name for name, number in LEVELS.items()}
    return numbers.get(text.strip(), text.strip().lower())


def get_logger(name: str) -> logging.Logger:
    """``logging.getLogger`` inside the package's hierarchy: a module's ``__name__`` as it is, a tool's name
    (``"generate"``) as ``codegeex_train.generate``."""
    return logging.getLogger(name if name == ROOT or name.startswith(ROOT + ".") else f"{ROOT}.{name}")


class _Formatter(logging.Formatter):
    def __init__(self, prefix: str, redact: Callable[[str], str] | None = None) -> None:
        super().__init__()
        self.prefix, self.redact = prefix, redact

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        if self.redact is not None:
            text = self.redact(text)
        if record.levelno != logging.INFO:
            text = f"{record.levelname.lower()}: {text}"
        return "\n".join(self.prefix + line for line in text.split("\n")) if self.prefix else text


class _ConsoleHandler(logging.Handler):
    """Info and debug to ``sys.<info_stream>``, warnings and errors to ``sys.stderr``, both as they are at the
    time of the line."""

    def __init__(self, info_stream: str) -> None:
        super().__init__()
        self.info_stream = info_stream

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = getattr(sys, self.info_stream if record.levelno < logging.WARNING else "stderr")
            tqdm.write(self.format(record), file=stream)
            stream.flush()
        except Exception:  # noqa: BLE001 - logging's own convention: report, never raise from a log call
            self.handleError(record)


def setup_logging(level: str = "info", rank: int = 0, all_ranks: bool = False,
                  info_stream: str = "stdout", redact: Callable[[str], str] | None = None) -> logging.Logger:
    """Configure the ``codegeex_train`` logger for this process (again on each call: the previous handler goes)
    and return it. ``level``: one of ``LEVELS``; ``rank``: this process's global rank; ``all_ranks``:
    ``--log-all-ranks``; ``info_stream``: "stdout" or "stderr"; ``redact``: applied to every line (credentials in
    the paths a line echoes: a launcher tees the console into a log file)."""
    if level not in LEVELS:
        raise ValueError(f"log level {level!r}: use one of {', '.join(LEVELS)}")
    if info_stream not in ("stdout", "stderr"):
        raise ValueError(f"info_stream {info_stream!r}: use stdout or stderr")
    logger = logging.getLogger(ROOT)
    for handler in [h for h in logger.handlers if isinstance(h, _ConsoleHandler)]:
        logger.removeHandler(handler)
    handler = _ConsoleHandler(info_stream)
    handler.setFormatter(_Formatter(f"[rank {rank}] " if all_ranks or rank != 0 else "", redact))
    logger.addHandler(handler)
    # Other ranks: warnings and errors only (what rank 0 says at info, they would repeat).
    logger.setLevel(LEVELS[level] if all_ranks or rank == 0 else max(LEVELS[level], logging.WARNING))
    # Records still propagate to the root logger (pytest's caplog, a program that embeds us): the root prints
    # nothing unless that program configured it to.
    return logger
