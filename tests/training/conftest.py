"""A tiny preprocessed corpus (a slice of the Python stdlib, shipped tokenizer) shared by training tests."""

import pytest

from codegeex_train.data.default_corpus import default_corpus_files
from codegeex_train.data.preprocess import TokenizerSpec, preprocess


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("data") / "stdlib"
    files = default_corpus_files()[:60]
    summary = preprocess(files, str(out), TokenizerSpec(), append_eod=True, workers=1)
    return summary.output_prefixes[0]
