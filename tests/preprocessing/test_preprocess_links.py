"""tools/preprocess_data.py reads only what lies inside its input directories (docs/security.md): a symbolic link in
a cloned repository (to a file the user can read, /proc/self/environ, a directory) is not followed, a FIFO is not
opened, and each skip is counted in the summary; inputs named on the command line are read as named."""

import importlib.util
import json
import os
from pathlib import Path

import pytest

from codegeex_train.data.indexed_dataset import MMapIndexedDataset
from codegeex_train.preprocessing.preprocess import TokenizerSpec
from tests.harness import deadline

TOOL = Path(__file__).resolve().parents[2] / "tools" / "preprocess_data.py"
SECRET = "hunter2_do_not_train_on_me"




def _run(argv: list[str], capsys) -> tuple[str, str]:
    spec = importlib.util.spec_from_file_location("preprocess_data_tool", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    with deadline(60):
        tool.main(argv)
    captured = capsys.readouterr()
    return captured.out, captured.err


def _texts(prefix: Path) -> list[str]:
    tokenizer = TokenizerSpec().build()
    return [tokenizer.decode(ids.tolist()) for ids in MMapIndexedDataset(f"{prefix}_text_document")]


@pytest.fixture()
def hostile(tmp_path) -> tuple[Path, Path]:
    """(a cloned repository holding links out of itself and one inside, a JSON lines file outside it)."""
    outside = tmp_path / "home"
    (outside / "keys").mkdir(parents=True)
    (outside / "credentials.py").write_text(f"TOKEN = '{SECRET}'\n")
    (outside / "keys" / "id.py").write_text(f"KEY = '{SECRET}'\n")
    repo = tmp_path / "clone"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "core.py").write_text("def area(w, h):\n    return w * h\n")
    (repo / "setup.py").write_text("from pkg.core import area\n")
    (repo / "env.py").symlink_to("/proc/self/environ")
    (repo / "settings.py").symlink_to(outside / "credentials.py")
    (repo / "relative.py").symlink_to(Path("..") / "home" / "credentials.py")
    (repo / "vendor").symlink_to(outside / "keys")  # a directory out of the clone
    (repo / "alias.py").symlink_to(Path("pkg") / "core.py")  # stays inside
    (repo / "dangling.py").symlink_to(repo / "gone.py")
    (repo / "loop.py").symlink_to("loop.py")
    (repo / "README").symlink_to(outside / "credentials.py")  # not a source file: never read, not counted
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"text": "x = 1\n"}) + "\n")
    link = tmp_path / "named.jsonl"
    link.symlink_to(corpus)  # named on the command line: read through its link
    return repo, link


@pytest.mark.parametrize("level", ["file", "repo"])
def test_links_in_an_input_directory_are_not_followed_and_are_counted(tmp_path, hostile, capsys, level):
    repo, named = hostile
    prefix = tmp_path / "out" / "p"
    inputs = [str(repo)] + ([str(named)] if level == "file" else [])
    out, err = _run(["--input", *inputs, "--output-prefix", str(prefix), "--document-level", level], capsys)
    texts = _texts(prefix)
    leaked = [i for i, t in enumerate(texts) if SECRET in t or "PATH=" in t]  # or /proc/self/environ's variables
    assert not leaked, f"documents {leaked} hold a file from outside the clone"  # (never print them: a CI log)
    if level == "file":
        assert sorted(texts) == sorted(["def area(w, h):\n    return w * h\n", "from pkg.core import area\n",
                                        "x = 1\n"])
    else:
        assert len(texts) == 1 and "alias.py" not in texts[0] and "pkg/core.py" in texts[0]
    assert "skipped 7 symbolic links in input directories (not followed: --follow-symlinks" in out, out
    assert "input directories: skipped 7 symbolic links" in err, err


def test_follow_symlinks_follows_links_to_files_inside_only(tmp_path, hostile, capsys):
    repo, _ = hostile
    prefix = tmp_path / "out" / "p"
    out, _ = _run(["--input", str(repo), "--output-prefix", str(prefix), "--document-level", "repo",
                   "--follow-symlinks"], capsys)
    (text,) = _texts(prefix)
    assert SECRET not in text and "PATH=" not in text, "the document holds a file from outside the clone"
    assert "alias.py\ndef area(w, h)" in text and "pkg/core.py\ndef area(w, h)" in text  # the link under its name
    # out of the clone (3), the directory link, the dangling one, the loop
    assert "skipped 6 symbolic links in input directories (leading out of them, to a directory or nowhere)" in out


def test_fifos_in_an_input_directory_are_skipped_and_counted_and_a_named_one_is_one_line(tmp_path, capsys):
    repo = tmp_path / "clone"
    repo.mkdir()
    (repo / "a.py").write_text("a = 1\n")
    os.mkfifo(repo / "pipe.py")  # opening it would block until a writer comes: never
    prefix = tmp_path / "out" / "p"
    out, _ = _run(["--input", str(repo), "--output-prefix", str(prefix)], capsys)
    assert _texts(prefix) == ["a = 1\n"]
    assert "skipped 1 FIFOs, sockets or devices in input directories" in out, out
    with pytest.raises(SystemExit) as exit_info:
        _run(["--input", str(repo / "pipe.py"), "--output-prefix", str(tmp_path / "out2" / "p")], capsys)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and err[-1].startswith("preprocess_data.py: error: ")
    assert "pipe.py: not a regular file or a directory" in err[-1], err
