"""Benchmark decontamination: drop training files that contain a benchmark problem's docstring or solution.

The rule is StarCoder's (bigcode-dataset decontamination/find_substrings.py, benchmark_data.py): a file is dropped
when it contains, ignoring case, a HumanEval prompt's docstring or canonical solution, or an MBPP problem's text or
code. Two changes, both stated in the report: strings are compared with every run of whitespace made one space
(a re-indented copy is still a copy), and strings shorter than ``min_chars`` (50) after that are not used: 29 of
HumanEval's canonical solutions are that short (``return len(string)``), and StarCoder's exact match dropped every
file that happens to contain one; those tasks are still covered by their docstrings. HumanEval-X adds each
language's prompt comment (the last ``\"\"\"`` docstring, ``/* */`` block or run of ``//`` lines) and solution.

Matching is fast enough to run beside the tokenizer: each string is indexed by its longest word; a file's
words (a set) select the few strings whose word it holds, and only those are searched for.

The problems are read where the evaluation reads them (tools/preprocess_data.py passes them in:
codegeex_train/evaluation/problems.py for HumanEval and HumanEval-X); MBPP from a path (google-research's
mbpp.jsonl, all its problems) or the hub's ``google-research-datasets/mbpp`` test split through ``datasets``.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

from codegeex_train.bounded_read import FileReadError, read_text

BENCHMARKS = ("humaneval", "humaneval-x", "mbpp")
DEFAULT_MIN_CHARS = 50
MBPP_HUB = "google-research-datasets/mbpp"
MAX_MBPP_BYTES = 256 << 20  # the most read of an MBPP file, decompressed (all of MBPP's 974 problems: under 1 MiB)
_WORD = re.compile(r"[a-z0-9_]+")  # on lower-cased text


class BenchmarkError(ValueError):
    """A benchmark that cannot be read; the message names the flag and the fix."""


@dataclasses.dataclass(frozen=True)
class BenchmarkString:
    """One string a training file must not contain."""

    benchmark: str
    task_id: str
    field: str
    """"docstring" or "canonical_solution" (HumanEval, HumanEval-X); "text" or "code" (MBPP)."""
    text: str


def normalize(text: str) -> str:
    """Lower case, every run of whitespace one space, no leading or trailing space."""
    return " ".join(text.lower().split())


def prompt_docstring(prompt: str) -> str:
    """The problem statement in a prompt: its last docstring (``\"\"\"`` or ``'''``), else its last ``/* */``
    comment, else its longest run of ``//`` comment lines, else the whole prompt."""
    for quote in ('"""', "'''"):
        parts = prompt.split(quote)
        if len(parts) >= 3:
            return parts[-2].strip()
    start = prompt.rfind("/*")
    end = prompt.find("*/", start + 2)
    if start >= 0 and end > start:
        return prompt[start + 2:end].strip("*").strip()
    best: list[str] = []
    run: list[str] = []
    for line in prompt.splitlines():
        run = run + [line.strip()] if line.strip().startswith("//") else []
        best = run if len(run) > len(best) else best
    return "\n".join(best) if best else prompt.strip()


def problem_strings(benchmark: str, problems: Mapping[str, dict]) -> list[BenchmarkString]:
    """Docstring and canonical solution of each HumanEval / HumanEval-X problem (``task_id -> problem``)."""
    out = []
    for task_id, problem in problems.items():
        out.append(BenchmarkString(benchmark, task_id, "docstring", prompt_docstring(problem["prompt"])))
        if isinstance(problem.get("canonical_solution"), str):
            out.append(BenchmarkString(benchmark, task_id, "canonical_solution", problem["canonical_solution"]))
    return out


def mbpp_strings(rows: Iterable[dict]) -> list[BenchmarkString]:
    """Text (the task, also ``prompt`` in sanitized-mbpp.json) and code of each MBPP problem."""
    out = []
    for row in rows:
        task_id = f"MBPP/{row.get('task_id')}"
        for field, key in (("text", "text"), ("text", "prompt"), ("code", "code")):
            if isinstance(row.get(key), str):
                out.append(BenchmarkString("mbpp", task_id, field, row[key]))
    return out


def read_mbpp(path: str | Path | None = None) -> list[dict]:
    """MBPP's problems: every row of ``path`` (JSON lines, optionally gzipped, or a JSON array as
    sanitized-mbpp.json), or the test split of the hub's dataset through ``datasets`` when ``path`` is None."""
    fix = "pass --decontaminate-data mbpp=PATH (mbpp.jsonl of the google-research/google-research repository)"
    if path is None:
        try:
            import datasets

            return [dict(row) for row in datasets.load_dataset(MBPP_HUB, split="test")]
        except Exception as e:  # noqa: BLE001 - offline, no such dataset, an old datasets...
            why = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise BenchmarkError(f"--decontaminate mbpp: cannot load {MBPP_HUB} with datasets ({why}): {fix}") from None
    path = Path(path)
    try:
        text = read_text(path, MAX_MBPP_BYTES, gunzip=True)
    except FileReadError as e:  # not a regular file, missing, over the bound, a broken .gz, not UTF-8
        raise BenchmarkError(f"--decontaminate-data mbpp: {e}: {fix}") from None
    try:
        rows = json.loads(text) if text.lstrip().startswith("[") else [json.loads(x) for x in text.splitlines()
                                                                       if x.strip()]
    except (ValueError, RecursionError) as e:
        raise BenchmarkError(f"--decontaminate-data mbpp={path}: cannot read it as MBPP's JSON lines ({e}): "
                             f"{fix}") from None
    if not rows or not all(isinstance(r, dict) and isinstance(r.get("code"), str) for r in rows):
        raise BenchmarkError(f"--decontaminate-data mbpp={path}: not MBPP's problems (objects with task_id, text, "
                             f"code): {fix}")
    return rows


class Decontaminator:
    """Which benchmark string a file contains (``match``, pure), and the record of dropped files (``drop``)."""

    def __init__(self, strings: Iterable[BenchmarkString], min_chars: int = DEFAULT_MIN_CHARS):
        self.min_chars = min_chars
        self.strings: list[tuple[str, BenchmarkString]] = []
        self.too_short: list[BenchmarkString] = []
        self.dropped: list[dict] = []
        self._by_word: dict[str, list[int]] = {}
        for string in strings:
            text = normalize(string.text)
            if len(text) < min_chars:
                self.too_short.append(string)
                continue
            words = _WORD.findall(text)
            self._by_word.setdefault(max(words, key=len) if words else "", []).append(len(self.strings))
            self.strings.append((text, string))
        self._words = set(self._by_word)
        self._always = self._by_word.get("", [])  # strings without a word: searched for in every file

    def match(self, content: str) -> BenchmarkString | None:
        """The first benchmark string (in benchmark order) that ``content`` contains, or None."""
        lower = content.lower()
        hits = self._words.intersection(_WORD.findall(lower))
        if not hits and not self._always:
            return None
        candidates = sorted({i for word in hits for i in self._by_word[word]} | set(self._always))
        text = " ".join(lower.split())
        return next((string for normalized, string in (self.strings[i] for i in candidates)
                     if normalized in text), None)

    def drop(self, origin: str, repo: str | None, path: str | None, string: BenchmarkString) -> None:
        self.dropped.append({"file": origin, "repo": repo, "path": path, "benchmark": string.benchmark,
                             "task_id": string.task_id, "field": string.field})

    def report(self) -> dict:
        """What PREFIX_decontamination.json holds: the rule, what was searched for, and every dropped file."""
        benchmarks = sorted({s.benchmark for _, s in self.strings} | {s.benchmark for s in self.too_short})
        return {
            "rule": "contains a benchmark string, ignoring case and with whitespace runs as one space (StarCoder's "
                    f"substring rule); strings shorter than {self.min_chars} characters are not used",
            "min_chars": self.min_chars,
            "strings": {b: sum(s.benchmark == b for _, s in self.strings) for b in benchmarks},
            "too_short": [{"benchmark": s.benchmark, "task_id": s.task_id, "field": s.field} for s in self.too_short],
            "dropped": len(self.dropped),
            "dropped_by_benchmark": {b: sum(d["benchmark"] == b for d in self.dropped) for b in benchmarks},
            "dropped_files": self.dropped,
        }
