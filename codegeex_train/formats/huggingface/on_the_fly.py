"""``--load HF_DIR`` in the tools that read a checkpoint (tools/generate.py, tools/evaluate_humaneval.py): a Hugging
Face model directory is converted on the fly, so that a starting model can be tried and evaluated before any
training::

    with checkpoint_dir(args.load) as (load, note):   # our checkpoint: itself, note None
        ...                                            # HF_DIR: a TP 1 checkpoint in a temporary directory

A Hugging Face model directory is one with a config.json and no ``latest`` (ours always have ``latest``). The
conversion is --from-hf's (adapter.py: any class it reads, its tokenizer recorded), into a temporary directory
removed on leaving; for repeated use, or another TP size, convert once with tools/convert_checkpoint.py --from-hf.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from codegeex_train.checkpoint.convert import Layout
from codegeex_train.checkpoint.files import CheckpointError


def is_hf_model_dir(path: str | Path) -> bool:
    """A Hugging Face model directory (config.json) rather than our checkpoint (``latest``)."""
    path = Path(path)
    return (path / "config.json").is_file() and not (path / "latest").exists()


@contextlib.contextmanager
def checkpoint_dir(load: str, tp_size: int = 1, flag: str = "--load") -> Iterator[tuple[str, str | None]]:
    """(a checkpoint directory of ours, a line saying what was done or None): ``load`` itself, or, for a Hugging
    Face model directory, its conversion at TP 1 in a temporary directory, removed on exit. CheckpointError at
    another ``tp_size`` (each process would convert the whole model)."""
    if not is_hf_model_dir(load):
        yield load, None
        return
    if tp_size != 1:
        raise CheckpointError(f"{flag} {load} is a Hugging Face model directory, converted on the fly at TP 1 only: "
                              f"convert it once with tools/convert_checkpoint.py --from-hf {load} --save DIR "
                              f"--tensor-model-parallel-size {tp_size}, then {flag} DIR")
    from codegeex_train.formats.huggingface.adapter import from_hf

    tmp = Path(tempfile.mkdtemp(prefix="codegeex-train-from-hf-"))
    try:
        from_hf(load, str(tmp / "checkpoint"), Layout(1, 1), make_vocab_size_divisible_by=128)
        yield str(tmp / "checkpoint"), (f"{flag} {load}: a Hugging Face model directory (config.json, no 'latest'): "
                                        f"converted on the fly to a TP 1 checkpoint in {tmp} (removed at exit; "
                                        f"tools/convert_checkpoint.py --from-hf converts it once)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
