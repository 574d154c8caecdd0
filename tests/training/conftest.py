"""Shared by the training tests: DeepSpeed's CPU comm op built once up front, and a tiny preprocessed
corpus (a slice of the Python stdlib with the shipped tokenizer)."""

import pytest

from codegeex_train.data.default_corpus import default_corpus_files
from codegeex_train.data.preprocess import TokenizerSpec, preprocess


@pytest.fixture(scope="session")
def deepspeed_ops():
    # The first deepspeed.initialize JIT-builds this op (40-75 s) into TORCH_EXTENSIONS_DIR. Building it
    # here, once, keeps that out of the spawned ranks' collective timeouts; later loads take milliseconds.
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None and builder.is_compatible():
        builder.load()


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory, deepspeed_ops) -> str:
    out = tmp_path_factory.mktemp("data") / "stdlib"
    files = default_corpus_files()[:60]
    summary = preprocess(files, str(out), TokenizerSpec(whitespace_encoding=True), append_eod=True, workers=1,
                         progress=False)
    return summary.output_prefixes[0]
