"""Corpus readers: every input format, both routes (iter_documents, load_corpus), bad input."""

import gzip
import json
import logging
import os
from pathlib import Path

import pytest

from codegeex_train.preprocessing.corpus import (
    CorpusError,
    CorpusStats,
    iter_documents,
    language_header,
    load_corpus,
    offline_datasets,
)
from codegeex_train.preprocessing.default_corpus import (
    EXCLUDED_DIRS,
    default_corpus_files,
    stdlib_source_dir,
)


def _rec(text: object, key: str = "text") -> str:
    return json.dumps({key: text, "meta": 1})


def _write_jsonl(path: Path, lines: list[str]) -> Path:
    data = "\n".join(lines) + "\n"
    if path.name.endswith(".gz"):
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(data)
    else:
        path.write_text(data, encoding="utf-8")
    return path


@pytest.fixture
def corpus_dir(tmp_path: Path) -> Path:
    """One file of every kind, plus a nested source tree with a file of another language."""
    _write_jsonl(tmp_path / "a.jsonl", [_rec("doc a1"), _rec("doc a2")])
    _write_jsonl(tmp_path / "b.jsonl.gz", [_rec("doc b1"), ""])  # blank lines are fine
    table = {"text": ["pq 1", "pq 2"], "n": [1, 2]}
    offline_datasets().Dataset.from_dict(table).to_parquet(tmp_path / "c.parquet")
    (tmp_path / "d.txt").write_text("line 1\nline 2\n")
    src = tmp_path / "src"
    (src / "pkg" / "sub").mkdir(parents=True)
    (src / "z.py").write_text("print('z')\n")
    (src / "pkg" / "a.py").write_text("def a():\n    pass\n")
    (src / "pkg" / "sub" / "b.py").write_text("b = 1\n")
    (src / "pkg" / "main.c").write_text("int main() {}\n")
    (src / "pkg" / "empty.py").write_text("")
    return tmp_path


def _inputs(root: Path) -> list[str]:
    return [str(root / n) for n in ("a.jsonl", "b.jsonl.gz", "c.parquet", "d.txt", "src")]


EXPECTED = [
    *("doc a1", "doc a2", "doc b1", "pq 1", "pq 2", "line 1\nline 2\n"),
    *("def a():\n    pass\n", "b = 1\n", "print('z')\n"),  # sorted by path: pkg/a, pkg/sub/b, z
]


def test_iter_documents_every_format(corpus_dir):
    stats = CorpusStats()
    assert list(iter_documents(_inputs(corpus_dir), stats=stats)) == EXPECTED
    assert (stats.files, stats.documents, stats.skipped, stats.empty) == (8, 9, 0, 1)


def test_language_tags_and_extensions(corpus_dir):
    src = [str(corpus_dir / "src")]
    docs = list(iter_documents(src, extensions=(".py", ".c"), language_tag=True))
    assert docs[0] == "# language: Python\ndef a():\n    pass\n"
    assert docs[1] == "// language: C\nint main() {}\n"
    assert len(docs) == 4
    assert language_header("x.rs") == "// language: Rust\n" and language_header("x.unknown") == ""


def test_other_json_key(tmp_path):
    _write_jsonl(tmp_path / "x.jsonl", [_rec("code 1", "content"), _rec("code 2", "content")])
    inputs = [str(tmp_path / "x.jsonl")]
    assert list(iter_documents(inputs, json_keys=("content", "text"))) == ["code 1", "code 2"]
    corpus = load_corpus(inputs, json_keys=("content",), cache_dir=str(tmp_path / "c"))
    assert list(corpus["text"]) == ["code 1", "code 2"]


def test_load_corpus_matches_iter_documents(corpus_dir, tmp_path):
    corpus = load_corpus(_inputs(corpus_dir), cache_dir=str(tmp_path / "hf_cache"))
    assert corpus.column_names == ["text"]
    assert list(corpus["text"]) == EXPECTED
    assert os.environ["HF_DATASETS_OFFLINE"] == "1"


# ---- bad input ----


def test_missing_input_names_path(tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(CorpusError, match="no such file") as err:
        list(iter_documents([missing]))
    assert missing in str(err.value)
    with pytest.raises(CorpusError, match="nope.jsonl"):
        load_corpus([missing])


def test_empty_corpus_names_inputs_and_extensions(tmp_path):
    (tmp_path / "notes.md").write_text("# not code")
    for read in (lambda: list(iter_documents([str(tmp_path)], extensions=(".rs",))),
                 lambda: load_corpus([str(tmp_path)], extensions=(".rs",))):
        with pytest.raises(CorpusError, match="no documents found") as err:
            read()
        assert str(tmp_path) in str(err.value) and ".rs" in str(err.value)


def test_unsupported_file_type(tmp_path):
    (tmp_path / "notes.md").write_text("hello")
    with pytest.raises(CorpusError, match="unsupported file type"):
        list(iter_documents([str(tmp_path / "notes.md")]))


@pytest.mark.parametrize("name", ["bad.jsonl", "bad.jsonl.gz"])
def test_bad_json_lines_name_file_and_line(tmp_path, name, caplog):
    lines = [_rec("ok 1"), "{not json", _rec("x", "other"), _rec(3), _rec("ok 2")]
    path = _write_jsonl(tmp_path / name, lines)
    with pytest.raises(CorpusError, match=r"bad\.jsonl(\.gz)?:2: not valid JSON.*skip_bad_lines"):
        list(iter_documents([str(path)]))
    stats = CorpusStats()
    with caplog.at_level(logging.WARNING):
        docs = list(iter_documents([str(path)], skip_bad_lines=True, stats=stats))
    assert docs == ["ok 1", "ok 2"]
    assert stats.skipped == 3
    assert "skipped 3 bad records" in caplog.text


def test_missing_field_names_line(tmp_path):
    path = _write_jsonl(tmp_path / "x.jsonl", [_rec("ok"), _rec("x", "other")])
    with pytest.raises(CorpusError, match=r"x\.jsonl:2: no string field 'text'"):
        list(iter_documents([str(path)]))


def test_load_corpus_bad_line_names_file_and_line(tmp_path):
    path = _write_jsonl(tmp_path / "x.jsonl", [_rec("ok"), _rec("ok"), "{oops"])
    with pytest.raises(CorpusError, match=r"x\.jsonl:3: not valid JSON"):
        load_corpus([str(path)], cache_dir=str(tmp_path / "c"))
    path = _write_jsonl(tmp_path / "y.jsonl", [_rec("ok"), _rec("x", "other")])
    with pytest.raises(CorpusError, match=r"y\.jsonl:2: no string field"):
        load_corpus([str(path)], cache_dir=str(tmp_path / "c"))


def test_parquet_missing_column(tmp_path):
    offline_datasets().Dataset.from_dict({"content": ["x"]}).to_parquet(tmp_path / "x.parquet")
    with pytest.raises(CorpusError, match="no column 'text'"):
        list(iter_documents([str(tmp_path / "x.parquet")]))


def test_non_utf8_source_file(tmp_path):
    (tmp_path / "good.py").write_text("x = 1\n")
    (tmp_path / "latin.py").write_bytes("s = 'caf\xe9'\n".encode("latin-1"))
    with pytest.raises(CorpusError, match="latin.py: not UTF-8"):
        list(iter_documents([str(tmp_path)]))
    stats = CorpusStats()
    assert list(iter_documents([str(tmp_path)], skip_bad_lines=True, stats=stats)) == ["x = 1\n"]
    assert stats.skipped == 1


# ---- the default corpus ----


def test_default_corpus_files():
    root = stdlib_source_dir()
    files = default_corpus_files()
    assert (root / "os.py") in files and len(files) > 300
    relative = [p.relative_to(root).as_posix() for p in files]
    assert relative == sorted(relative)
    assert not any(EXCLUDED_DIRS.intersection(Path(r).parts) for r in relative)
    limited = default_corpus_files(limit_bytes=200_000)
    assert limited == files[: len(limited)]
    assert sum(p.stat().st_size for p in limited) <= 200_000
    assert default_corpus_files(limit_bytes=1) == files[:1]
