"""tools/preprocess_data.py: read-back equals the tokenizer's output; worker count is invisible."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from codegeex_train.preprocessing.default_corpus import default_corpus_files
from codegeex_train.data.indexed_dataset import MMapIndexedDataset
from codegeex_train.preprocessing.preprocess import (
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


# --- Megatron-LM's flags (config/megatron_flags.py PREPROCESS_DATA) -------------------------------------------------

def _tool():
    spec = importlib.util.spec_from_file_location("preprocess_data_tool", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def _one_error_line(capsys, tool, argv):
    with pytest.raises(SystemExit) as exit_info:
        tool.parse_args(["--output-prefix", "out", *argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("preprocess_data.py: error: "), err
    return lines[0]


def test_megatron_tokenizer_type_and_flags_are_accepted(capsys):
    from codegeex_train.config.megatron_flags import PREPROCESS_DATA

    tool = _tool()
    base = ["--output-prefix", "out"]
    plain = vars(tool.parse_args(base))
    for key, entry in PREPROCESS_DATA.items():
        if entry.kind == "alias":  # --tokenizer-type HuggingFaceTokenizer (not one of our choices) -> ours
            theirs, ours = vars(tool.parse_args(base + key.split())), vars(tool.parse_args(base + entry.ours.split()))
            assert theirs == ours and theirs["tokenizer_type"] == entry.ours.split()[1], key
    # Megatron's runtime flags: accepted, the same arguments as without them (--workers is ours already).
    megatron = vars(tool.parse_args(base + ["--workers", "4", "--partitions", "1", "--keep-newlines",
                                            "--keep-sequential-samples", "--lang", "english", "--dataset-impl", "mmap"]))
    assert {k: v for k, v in megatron.items() if not k.startswith("ignored ")} == {**plain, "workers": 4}
    assert capsys.readouterr().err == ""  # --partitions 1: nothing to say
    tool.parse_args(base + ["--partitions", "8", "--workers", "2"])
    note = capsys.readouterr().err.splitlines()
    assert len(note) == 1 and note[0].startswith("preprocess_data.py: note: --partitions 8") and "--workers 2" in note[0]


@pytest.mark.parametrize("argv,fragments", [
    (["--split-sentences"], ["--split-sentences (Megatron-LM) is not supported here", "nltk", "ours: none"]),
    (["--tokenizer-type", "Llama2Tokenizer"], ["Llama2Tokenizer (Megatron-LM)", "ours: --tokenizer-type HFTokenizer"]),
    (["--vocab-size", "786"], ["--vocab-size (Megatron-LM)", "ours: --tokenizer-type HFTokenizer"]),
    (["--worker", "2"], ["unrecognized argument --worker (did you mean --workers?)"]),
    (["--workers", "0"], ["--workers 0: must be >= 1"]),
])
def test_refused_unknown_and_bad_flags_are_one_line(capsys, argv, fragments):
    line = _one_error_line(capsys, _tool(), argv)
    for fragment in fragments:
        assert fragment in line, line
