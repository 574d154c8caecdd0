"""Repository-level documents (tools/preprocess_data.py --document-level repo): a document decodes back to its
repository's files, in the order asked for, with their paths; sentinels are ids, never text; The Stack's and
StarCoderData's rows and source trees are read as they are; bad values are one line."""

import importlib.util
import json
import random
from pathlib import Path

import pytest

from codegeex_train.tokenization.code_tokens import code_tokens
from codegeex_train.preprocessing.corpus import CorpusError
from codegeex_train.data.indexed_dataset import MMapIndexedDataset
from codegeex_train.preprocessing.preprocess import TokenizerSpec, preprocess
from codegeex_train.preprocessing.repo_documents import (
    REPO_FORMATS,
    DocumentSpec,
    Repository,
    decode_repository,
    encode_repository,
    group_repositories,
)
from codegeex_train.preprocessing.source_files import SourceFields, SourceFile
from codegeex_train.tokenization.tokenizer import build_tokenizer

TOOL = Path(__file__).resolve().parents[2] / "tools" / "preprocess_data.py"
SPEC = TokenizerSpec(whitespace_encoding=True)
# Text that looks like the layout must stay text: a literal sentinel, a fake header, whitespace runs, non-ASCII.
TRICKY = "x = '<file_sep><repo_name><|extratoken_6|>'\n###PATH: fake.py\n###LANGUAGE:Go\n        y = 'héllo'\n"


def _files(repo: str, paths: list[str]) -> list[SourceFile]:
    return [SourceFile(f"# {repo}/{p}\ndef f{i}():\n    return {i}\n" + (TRICKY if i == 1 else ""), repo, p,
                       "Python", f"in:{i}") for i, p in enumerate(paths)]


@pytest.fixture(scope="module")
def tokenizer():
    tok = SPEC.build()
    return tok, code_tokens(tok)


@pytest.mark.parametrize("fmt", sorted(REPO_FORMATS))
@pytest.mark.parametrize("order", ["path", "random"])
def test_a_repository_document_decodes_back_to_its_files_in_order(tokenizer, fmt, order):
    tok, tokens = tokenizer
    files = _files("octo/cat", ["src/z.py", "a.py", "src/b/c.py", "README.py", "m.py"])
    (repo,) = group_repositories(files, order, seed=7)
    expected = sorted(files, key=lambda f: f.path)
    if order == "random":  # the docstring's contract: the path-sorted files shuffled by Random(f"{seed}/{name}")
        random.Random("7/octo/cat").shuffle(expected)
        assert expected != sorted(files, key=lambda f: f.path)
    assert [f.path for f in repo.files] == [f.path for f in expected]
    ids = encode_repository(tok, tokens, REPO_FORMATS[fmt], repo) + [tok.eod]
    # The sentinels are exactly the layout's: one <file_sep> a file, <repo_name> once for starcoder2, none in text.
    assert ids.count(tokens.file_sep) == len(files)
    named = REPO_FORMATS[fmt].repo_name
    assert ids.count(tokens.repo_name) == (1 if named else 0)
    name, decoded = decode_repository(tok, tokens, REPO_FORMATS[fmt], ids)
    assert name == ("octo/cat" if named else None)
    assert decoded == [(f.path, f.content) for f in expected]
    # The layout as text (sentinels spelled out), against the formats the module docstring states.
    text = tok.decode(ids[:-1]).replace(tok.decode([tokens.file_sep]), "<file_sep>").replace(
        tok.decode([tokens.repo_name]), "<repo_name>")
    if fmt == "starcoder2":
        assert text == "<repo_name>octo/cat" + "".join(f"<file_sep>{f.path}\n{f.content}" for f in expected)
    elif fmt == "qwen2.5-coder":
        assert text == "<repo_name>octo/cat\n" + "".join(f"<file_sep>{f.path}\n{f.content}" for f in expected)
    else:
        assert text == "".join(f"<file_sep>###PATH: {f.path}\n###LANGUAGE:Python\n{f.content}" for f in expected)


def test_random_order_is_seeded_and_independent_of_the_input_order():
    files = _files("r", [f"f{i}.py" for i in range(12)])
    first = group_repositories(files, "random", seed=1)[0].files
    assert group_repositories(files[::-1], "random", seed=1)[0].files == first
    assert group_repositories(files, "random", seed=2)[0].files != first
    assert sorted(first, key=lambda f: f.path) == sorted(files, key=lambda f: f.path)


def test_repositories_keep_their_first_appearance_order():
    files = [SourceFile("a", "r2", "x.py", None, "1"), SourceFile("b", "r1", "y.py", None, "2"),
             SourceFile("c", "r2", "a.py", None, "3")]
    repos = group_repositories(files)
    assert [(r.name, [f.path for f in r.files]) for r in repos] == [("r2", ["a.py", "x.py"]), ("r1", ["y.py"])]


def _documents(prefix: str, tok, tokens, fmt: str) -> list[tuple]:
    data = MMapIndexedDataset(prefix)
    return [decode_repository(tok, tokens, REPO_FORMATS[fmt], data[i].tolist()) for i in range(len(data))]


def test_source_trees_become_one_document_per_repository(tmp_path, tokenizer, capsys):
    tok, tokens = tokenizer
    trees = {"alpha": {"pkg/b.py": "import os\n", "a.py": "print(1)\n" + TRICKY},
             "beta": {"main.py": "def main():\n    pass\n"}}
    for repo, files in trees.items():
        for path, text in files.items():
            (tmp_path / repo / path).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / repo / path).write_text(text)
    out = tmp_path / "out" / "repo"
    summary = preprocess([str(tmp_path / "alpha"), str(tmp_path / "beta")], str(out), SPEC, append_eod=True,
                         workers=2, progress=False, documents=DocumentSpec(level="repo"))
    assert (summary.documents, summary.files) == (2, 3)
    assert _documents(f"{out}_text_document", tok, tokens, "starcoder2") == [
        (repo, sorted(files.items())) for repo, files in trees.items()]
    # The shipped tokenizer lacked the sentinels: the augmented one is saved, and gives training the same ids.
    saved = build_tokenizer("HFTokenizer", f"{out}_tokenizer.json", whitespace_encoding=True)
    assert code_tokens(saved) == tokens and saved.vocab_size == tok.vocab_size
    assert f"--tokenizer-type HFTokenizer --tokenizer-model {out}_tokenizer.json" in str(summary)


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_the_stack_and_starcoderdata_rows_as_they_are(tmp_path, tokenizer):
    tok, tokens = tokenizer
    stack = [{"max_stars_repo_name": "o/r", "max_stars_repo_path": "b.cpp", "lang": "C++", "content": "int b;\n"},
             {"max_stars_repo_name": "o/s", "max_stars_repo_path": "x.py", "lang": "Python", "content": "x = 1\n"},
             {"max_stars_repo_name": "o/r", "max_stars_repo_path": "a.h", "lang": "C", "content": "int a;\n"}]
    starcoderdata = [{k: v for k, v in row.items() if k != "lang"} for row in stack]  # no language field
    for name, rows in (("stack", stack), ("starcoderdata", starcoderdata)):
        out = str(tmp_path / name)
        preprocess([_jsonl(tmp_path / f"{name}.jsonl", rows)], out, SPEC, json_keys=["content"], progress=False,
                   documents=DocumentSpec(level="repo", repo_format="codegeex4"))
        data = MMapIndexedDataset(f"{out}_content_document")
        texts = [tok.decode([t for t in data[i].tolist() if t != tokens.file_sep]) for i in range(len(data))]
        # The language header: The Stack's lang, else the extension's language (a.h is C either way).
        assert texts == ["###PATH: a.h\n###LANGUAGE:C\nint a;\n###PATH: b.cpp\n###LANGUAGE:C++\nint b;\n",
                         "###PATH: x.py\n###LANGUAGE:Python\nx = 1\n"]
    # File level with CodeGeeX's tag: the row's language decides the comment syntax.
    out = str(tmp_path / "tagged")
    preprocess([str(tmp_path / "stack.jsonl")], out, SPEC, json_keys=["content"], language_tag=True, progress=False)
    data = MMapIndexedDataset(f"{out}_content_document")
    assert [tok.decode(data[i].tolist()) for i in range(3)] == [
        "// language: C++\nint b;\n", "# language: Python\nx = 1\n", "// language: C\nint a;\n"]


def test_custom_columns_and_rows_without_a_repository(tmp_path):
    rows = [{"repo": "r", "file": "a.py", "code": "a = 1\n"}, {"file": "b.py", "code": "b = 2\n"}]
    path = _jsonl(tmp_path / "rows.jsonl", rows)
    custom = DocumentSpec(level="repo", fields=SourceFields("repo", "file", "language"))
    with pytest.raises(CorpusError, match=r"rows\.jsonl:2: no string field 'repo' \(--repo-key\).*--skip-bad-lines"):
        preprocess([path], str(tmp_path / "x"), SPEC, json_keys=["code"], progress=False, documents=custom)
    assert list(tmp_path.glob("x*")) == []
    summary = preprocess([path], str(tmp_path / "y"), SPEC, json_keys=["code"], progress=False, documents=custom,
                         skip_bad_lines=True)
    assert (summary.documents, summary.files, summary.skipped_bad) == (1, 1, 1)


def _tool():
    spec = importlib.util.spec_from_file_location("preprocess_data_tool", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


@pytest.mark.parametrize("argv,fragment", [
    (["--document-level", "repository"], "argument --document-level: invalid choice: 'repository'"),
    (["--repo-format", "starcoder"], "argument --repo-format: invalid choice: 'starcoder'"),
    (["--file-order", "shuffle"], "argument --file-order: invalid choice: 'shuffle'"),
    (["--seed", "x"], "argument --seed: invalid int value: 'x'"),
    (["--repo-key", ""], "--repo-key: a column name, not empty"),
    (["--document-level", "repo", "--language-tag"], "--language-tag is for --document-level file"),
    (["--document-level", "repo", "--json-keys", "a", "b"], "--json-keys a b: --document-level repo works on one"),
])
def test_bad_values_are_one_line(capsys, tmp_path, argv, fragment):
    with pytest.raises(SystemExit) as exit_info:
        _tool().main(["--output-prefix", str(tmp_path / "p"), *argv])
    lines = capsys.readouterr().err.splitlines()
    assert exit_info.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("preprocess_data.py: error: ") and fragment in lines[0], lines[0]
    assert list(tmp_path.iterdir()) == []


def test_cli_repository_documents(tmp_path, capsys):
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "a.py").write_text("a = 1\n")
    (tmp_path / "repo" / "b.py").write_text("b = 2\n")
    _tool().main(["--input", str(tmp_path / "repo"), "--output-prefix", str(tmp_path / "out" / "p"),
                  "--document-level", "repo", "--file-order", "random", "--seed", "3", "--whitespace-encoding"])
    assert "1 documents" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "p_text_document.bin", "p_text_document.idx", "p_text_document.meta.json", "p_tokenizer.json"]
    tok = build_tokenizer("HFTokenizer", str(tmp_path / "out" / "p_tokenizer.json"), whitespace_encoding=True)
    order = [f.path for f in group_repositories(_files("repo", ["a.py", "b.py"]), "random", 3)[0].files]
    name, files = decode_repository(tok, code_tokens(tok), REPO_FORMATS["starcoder2"],
                                    MMapIndexedDataset(str(tmp_path / "out" / "p_text_document"))[0].tolist())
    assert (name, [p for p, _ in files]) == ("repo", order)
    assert Repository("r", ()).chars == 0
