"""The embedded default corpus: this Python's own standard library source.

Always present, needs no download, and is real indented code: enough to train the default
tokenizer and to smoke-test pretraining. Test suites and third-party packages are left out, and
the file order is fixed, so the same Python version always gives the same corpus.
"""

import os
import sysconfig
from pathlib import Path

EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)
"""Directory names skipped anywhere under the stdlib: installed packages and test suites."""


def stdlib_source_dir() -> Path:
    """The standard library of the running interpreter (the base one, even inside a venv)."""
    return Path(sysconfig.get_paths()["stdlib"])


def default_corpus_files(limit_bytes: int | None = None) -> list[Path]:
    """The stdlib's .py files, sorted by relative path, stopping before `limit_bytes` is exceeded.

    With a limit, at least the first file is returned (so a tiny limit still gives a corpus).
    """
    root = stdlib_source_dir()
    candidates: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune in place: site-packages can be far larger than the stdlib itself.
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]
        candidates.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    candidates.sort(key=lambda p: p.relative_to(root).as_posix())
    files: list[Path] = []
    total = 0
    for path in candidates:
        size = path.stat().st_size
        if limit_bytes is not None and files and total + size > limit_bytes:
            break
        files.append(path)
        total += size
    return files
