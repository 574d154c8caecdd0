"""Reading HumanEval problems and samples: the shipped data and files in its format, plain or gzipped."""

import gzip
import json

import pytest

from codegeex_train.evaluation import ProblemsError, humaneval_data_path, read_problems, read_samples, write_jsonl
from codegeex_train.evaluation.humaneval import build_program, select_tasks


def test_the_shipped_problems():
    assert humaneval_data_path().name == "HumanEval.jsonl.gz"
    problems = read_problems()
    assert len(problems) == 164
    assert list(problems)[:2] == ["HumanEval/0", "HumanEval/1"] and list(problems)[-1] == "HumanEval/163"
    first = problems["HumanEval/0"]
    assert first["entry_point"] == "has_close_elements"
    assert "def check(candidate)" in first["test"] and first["canonical_solution"].startswith("    ")
    assert list(select_tasks(problems, 3)) == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]


def test_program_is_prompt_completion_tests_and_the_check_call():
    problem = {"task_id": "t/0", "prompt": "def f(x):\n", "test": "def check(c):\n    assert c(1) == 2\n",
               "entry_point": "f"}
    assert build_program(problem, "    return x + 1\n") == (
        "def f(x):\n    return x + 1\n\ndef check(c):\n    assert c(1) == 2\n\ncheck(f)\n")


@pytest.mark.parametrize("name", ["problems.jsonl", "problems.jsonl.gz"])
def test_any_file_in_the_format_plain_or_gzipped(tmp_path, name):
    records = [{"task_id": f"t/{i}", "prompt": "def f():\n", "test": "def check(c): pass\n", "entry_point": "f"}
               for i in range(3)]
    write_jsonl(tmp_path / name, records)
    if name.endswith(".gz"):
        with gzip.open(tmp_path / name, "rt") as f:
            assert json.loads(f.readline())["task_id"] == "t/0"
    assert list(read_problems(tmp_path / name)) == ["t/0", "t/1", "t/2"]


@pytest.mark.parametrize("content,fragment", [
    ('{"task_id": "t/0", "prompt": "x"}\n', "needs string fields test, entry_point"),
    ('{"task_id": "t/0", "prompt": "p", "test": "t", "entry_point": "f"}\n{bad\n', "problems.jsonl:2: not valid JSON"),
    ('[1, 2]\n', "expected a JSON object"),
    ('\n\n', "holds no problems"),
    ('{"task_id": "t", "prompt": "p", "test": "t", "entry_point": "f"}\n' * 2, "appears twice"),
])
def test_bad_problem_files_say_where(tmp_path, content, fragment):
    (tmp_path / "problems.jsonl").write_text(content)
    with pytest.raises(ProblemsError, match=fragment):
        read_problems(tmp_path / "problems.jsonl")


def test_missing_and_truncated_files(tmp_path):
    with pytest.raises(ProblemsError, match="no such file"):
        read_problems(tmp_path / "nope.jsonl")
    data = gzip.compress(b'{"task_id": "t/0", "completion": "x"}\n' * 100)
    (tmp_path / "cut.jsonl.gz").write_bytes(data[: len(data) // 2])
    with pytest.raises(ProblemsError, match="cannot read"):
        read_samples(tmp_path / "cut.jsonl.gz")


def test_samples(tmp_path):
    write_jsonl(tmp_path / "s.jsonl", [{"task_id": "t/0", "completion": "  pass\n"}, {"task_id": "t/0", "completion": ""}])
    assert [s["completion"] for s in read_samples(tmp_path / "s.jsonl")] == ["  pass\n", ""]
    (tmp_path / "bad.jsonl").write_text('{"task_id": "t/0"}\n')
    with pytest.raises(ProblemsError, match="bad.jsonl:1: a sample needs"):
        read_samples(tmp_path / "bad.jsonl")
