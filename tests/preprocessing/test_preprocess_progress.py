"""Preprocessing's progress bars have a total from their first line and end at it: the inputs' size on disk for the
bars that follow reading (file documents; reading before repositories are grouped), the number of repositories for
tokenizing them."""

import re

import pytest

from codegeex_train.preprocessing.preprocess import DocumentSpec, TokenizerSpec, preprocess

FILES = {"a/x.py": "def f():\n    return 1\n", "a/y.py": "X = [1, 2, 3]\n" * 5, "b/z.py": "import os\n" * 9}


def renders(text: str, desc: str) -> list[tuple[int, int | None]]:
    """(n, total) of every line tqdm drew for the bar ``desc`` (bytes below 1000 print as they are)."""
    out = []
    for line in re.split(r"[\r\n]", text):
        if line.startswith(desc + ":"):
            m = re.search(r"\| *(\d+)(?:\.\d+)?[A-Za-z]*/(\d+)", line)
            out.append((int(m.group(1)), int(m.group(2))) if m else (None, None))
    return out


@pytest.mark.parametrize("level", ["file", "repo"])
def test_bars_have_a_total_from_the_first_line_and_reach_it(tmp_path, capsys, level):
    for name, text in FILES.items():
        (tmp_path / "src" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "src" / name).write_text(text)
    size = sum(len(t.encode()) for t in FILES.values())
    documents = DocumentSpec(level=level, repo_format="starcoder2") if level == "repo" else DocumentSpec()
    preprocess([str(tmp_path / "src" / "a"), str(tmp_path / "src" / "b")], str(tmp_path / "out" / "p"),
               TokenizerSpec(), workers=1, progress=True, documents=documents)
    err = capsys.readouterr().err
    bytes_bar = renders(err, "tokenizing text" if level == "file" else "reading text")
    assert bytes_bar and all(total == size for _, total in bytes_bar), err
    assert bytes_bar[-1][0] == size, err  # the last file counted too
    if level == "repo":  # a source tree is a repository: two of them
        repos = renders(err, "tokenizing text")
        assert repos and all(total == 2 for _, total in repos) and repos[-1][0] == 2, err
