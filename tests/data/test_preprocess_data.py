"""tools/preprocess_data.py: read-back equals the tokenizer's output; worker count is invisible."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from codegeex_train.data.default_corpus import default_corpus_files
from codegeex_train.data.indexed_dataset import MMapIndexedDataset
from codegeex_train.data.preprocess import (
    TokenizerSpec,
    output_prefix_for,
    preprocess,
    resolve_inputs,
)

TOOL = Path(__file__).resolve().parents[2] / "tools" / "preprocess_data.py"
SPEC = TokenizerSpec(whitespace_encoding=True)  # the shipped tokenizer, as it is meant to be used

DOCS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x):\n        self.x = x\n",
    "print('héllo wörld')  # unicode\n",
    "x = [i * i for i in range(10)]\n" * 5,
    "import os\n\n\nos.path.join('a', 'b')\n",
]


@pytest.fixture(scope="module")
def tokenizer():
    return SPEC.build()


@pytest.fixture()
def corpus(tmp_path):
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d, "content": d.upper()}) + "\n" for d in DOCS))
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    for i, doc in enumerate(DOCS):
        (src / ("pkg" if i % 2 else "") / f"m{i}.py").write_text(doc)
    (src / "notes.txt").write_text("not python")
    return jsonl, src


def _read(prefix: str) -> list[list[int]]:
    return [ds.tolist() for ds in MMapIndexedDataset(prefix)]


@pytest.mark.parametrize("kind", ["jsonl", "dir"])
def test_documents_read_back_and_workers_agree(tmp_path, corpus, tokenizer, kind):
    source = corpus[0] if kind == "jsonl" else corpus[1]
    outputs = []
    for workers in (1, 2):
        prefix = str(tmp_path / f"out{workers}")
        summary = preprocess(
            [str(source)], prefix, SPEC, append_eod=True, workers=workers, docs_per_batch=2,
            progress=False,
        )
        assert summary.documents == len(DOCS)
        assert summary.output_prefixes == [output_prefix_for(prefix, "text")]
        outputs.append(summary.output_prefixes[0])
    for suffix in (".bin", ".idx"):
        assert Path(outputs[0] + suffix).read_bytes() == Path(outputs[1] + suffix).read_bytes()
    read = _read(outputs[0])
    # Directories are read in sorted relative-path order: m0, m2, m4, then pkg/m1, pkg/m3.
    order = range(5) if kind == "jsonl" else [0, 2, 4, 1, 3]
    expected = [tokenizer.encode(DOCS[i]) + [tokenizer.eod] for i in order]
    assert read == expected
    assert MMapIndexedDataset(outputs[0]).dtype == np.uint16
    assert summary.tokens == sum(len(ids) for ids in expected)


def test_cli_multiple_json_keys(tmp_path, corpus, tokenizer):
    spec = importlib.util.spec_from_file_location("preprocess_data_tool", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    prefix = str(tmp_path / "cli")
    tool.main([
        "--input", str(corpus[0]), "--output-prefix", prefix, "--json-keys", "text", "content",
        "--whitespace-encoding", "--workers", "2", "--log-interval", "1",
    ])
    assert _read(f"{prefix}_text_document") == [tokenizer.encode(d) for d in DOCS]
    assert _read(f"{prefix}_content_document") == [tokenizer.encode(d.upper()) for d in DOCS]


def test_bad_worker_count(tmp_path, corpus):
    with pytest.raises(ValueError, match="--workers"):
        preprocess([str(corpus[0])], str(tmp_path / "x"), SPEC, workers=0)


def test_default_input_is_the_stdlib_corpus(tmp_path):
    assert resolve_inputs(["default"]) == resolve_inputs([]) == [str(p) for p in default_corpus_files()]
    with pytest.raises(ValueError, match="cannot be combined"):
        resolve_inputs(["default", str(tmp_path)])
