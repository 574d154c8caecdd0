"""Where records go: the console and a JSON-lines file (wandb: ``wandb_sink.py``, TensorBoard:
``tensorboard_sink.py``)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Protocol, TextIO

from tqdm import tqdm

from codegeex_train.metrics.records import format_record


class Sink(Protocol):
    def write(self, record: dict) -> None: ...
    def close(self) -> None: ...


class ConsoleSink:
    """Prints each record as one line on stdout, through tqdm so an active progress bar is redrawn below."""

    def __init__(self, train_iters: int) -> None:
        self.train_iters = train_iters

    def write(self, record: dict) -> None:
        tqdm.write(format_record(record, self.train_iters), file=sys.stdout)
        sys.stdout.flush()

    def close(self) -> None:
        pass


class JsonlSink:
    """Appends one JSON object per record and flushes, so a crash loses at most the line being written."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO = self.path.open("a", encoding="utf-8")

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
