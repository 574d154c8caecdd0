"""``tools/evaluate_humaneval.py`` as a user runs it: --samples on a few tasks writes the per-sample results,
prints pass@k and appends the record to the run's metrics.jsonl (and wandb); bad input ends with one error
line."""

import json
import re
import sys
from pathlib import Path

import pytest

from codegeex_train.evaluation import ProblemsError, read_problems, write_jsonl
from codegeex_train.metrics import read_offline_wandb_history
from tests.harness import read_metrics, run_process_group

ROOT = Path(__file__).resolve().parents[2]
TOOL = [sys.executable, str(ROOT / "tools" / "evaluate_humaneval.py")]
ERROR_LINE = re.compile(r"^evaluate_humaneval\.py: error: \S")


def run_tool(*args, timeout=300):
    return run_process_group(TOOL + [str(a) for a in args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.fixture(scope="module")
def samples_file(tmp_path_factory):
    """Two samples for each of the first three tasks: task 0 and 1 one right and one wrong, task 2 both right."""
    problems = read_problems()
    samples = []
    for i, (task, problem) in enumerate(list(problems.items())[:3]):
        samples.append({"task_id": task, "completion": problem["canonical_solution"]})
        samples.append({"task_id": task, "completion": problem["canonical_solution"] if i == 2 else "    return None\n"})
    path = tmp_path_factory.mktemp("samples") / "samples.jsonl"
    write_jsonl(path, samples)
    return path


@pytest.mark.slow
def test_samples_end_to_end(samples_file, tmp_path):
    run_dir = tmp_path / "run"
    args = ["--samples", samples_file, "--tasks", 3, "--k", "1,2,10", "--output", tmp_path / "results.jsonl",
            "--run-dir", run_dir, "--iteration", 7, "--workers", 2, "--timeout", 20]
    result = run_tool(*args, "--wandb-project", "humaneval-test", "--wandb-name", "eval")
    assert result.returncode == 0, result.stderr
    assert "pass@1: 0.6667" in result.stdout and "pass@2: 1.0000" in result.stdout, result.stdout
    assert "pass@10 not reported" in result.stderr and "sandbox (2 workers)" in result.stderr

    results = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [(r["task_id"], r["sample"], r["passed"]) for r in results] == [
        ("HumanEval/0", 0, True), ("HumanEval/0", 1, False), ("HumanEval/1", 0, True), ("HumanEval/1", 1, False),
        ("HumanEval/2", 0, True), ("HumanEval/2", 1, True)]
    assert results[1]["result"].startswith("failed: ")

    expected = {"iteration": 7, "split": "humaneval", "humaneval_pass@1": pytest.approx(2 / 3),
                "humaneval_pass@2": 1.0, "humaneval_tasks": 3, "humaneval_samples_per_task": 2, "scoring": "strict"}
    assert read_metrics(run_dir) == [expected]
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    rows = read_offline_wandb_history(runs[0])
    assert rows[0]["humaneval/pass@1"] == pytest.approx(2 / 3) and rows[0]["_step"] == 7

    # The results file is a samples file too; a second evaluation appends its record. Samples of tasks that are
    # not among the problems are skipped and counted with --skip-unknown-tasks; the record names the scoring.
    with open(tmp_path / "results.jsonl", "a") as f:
        f.write('{"task_id": "CPP/0", "completion": ""}\n{"task_id": "HumanEval/999", "completion": ""}\n')
    again = run_tool("--samples", tmp_path / "results.jsonl", "--tasks", 3, "--run-dir", run_dir, "--workers", 2,
                     "--timeout", 20, "--skip-unknown-tasks", "--scoring", "codegeex")
    assert again.returncode == 0, again.stderr
    assert "skipped 2 sample(s) of tasks not among the problems" in again.stdout, again.stdout
    records = read_metrics(run_dir)
    assert len(records) == 2 and records[1]["iteration"] == 0 and records[1]["humaneval_pass@1"] == pytest.approx(2 / 3)
    assert records[1]["unknown_task_samples"] == 2 and records[1]["scoring"] == "codegeex"


CASES = [
    (["--samples", "{d}/nope.jsonl"], "nope.jsonl: no such file"),
    (["--samples", "{s}"], "161 of the 164 tasks have no samples"),
    (["--samples", "{s}", "--tasks", "0"], "--tasks 0"),
    (["--samples", "{s}", "--k", "0,1"], "--k"),
    (["--samples", "{s}", "--num-samples-per-task", "5"], "--num-samples-per-task"),
    (["--samples", "{d}/bad.jsonl"], "bad.jsonl:1: not valid JSON"),
    (["--samples", "{s}", "--problems", "{d}/bad.jsonl"], "bad.jsonl:1: not valid JSON"),
    (["--samples", "{d}/late.jsonl", "--tasks", "2"], "no sample is for one of the 2 tasks"),
    # Samples of unknown tasks (before: dropped without a word): the file, the first ones with their lines, how
    # many, and the fix.
    (["--samples", "{d}/mixed.jsonl", "--tasks", "1"], "mixed.jsonl: 2 sample(s) are for tasks not among the "
     "python problems (the default ones), first CPP/0 (line 3), JavaScript/0 (line 4): pass --language "
     "python,cpp,js, or --skip-unknown-tasks"),
    (["--samples", "{s}", "--load", "{d}"], "exactly one of --load"),
    ([], "exactly one of --load"),
    (["--load", "{d}/empty"], "no checkpoint in"),
    (["--samples", "{s}", "--tasks", "3", "--wandb-project", "p"], "--run-dir"),
]


@pytest.mark.parametrize("args,fragment", CASES, ids=[str(i) for i in range(len(CASES))])
def test_bad_input_ends_with_one_error_line(samples_file, tmp_path, args, fragment):
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    (tmp_path / "late.jsonl").write_text('{"task_id": "HumanEval/5", "completion": "pass"}\n')
    (tmp_path / "mixed.jsonl").write_text('{"task_id": "HumanEval/0", "completion": ""}\n\n'
                                          '{"task_id": "CPP/0", "completion": ""}\n'
                                          '{"task_id": "JavaScript/0", "completion": ""}\n')
    (tmp_path / "empty").mkdir()
    result = run_tool(*[a.format(d=tmp_path, s=samples_file) for a in args], timeout=120)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines and ERROR_LINE.match(lines[-1]), result.stderr
    assert sum(bool(ERROR_LINE.match(line)) for line in lines) == 1, result.stderr
    assert fragment in lines[-1], lines[-1]


def test_unknown_tasks_in_process(capsys, tmp_path):
    """The tool's functions in this process (no tool start): ids of no known language get the general fix;
    --skip-unknown-tasks counts them; it is for --samples files only (generated and canonical samples are the
    problems' own)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("evaluate_humaneval", ROOT / "tools" / "evaluate_humaneval.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    problems = {"python": read_problems()}
    numbered = [(1, {"task_id": "Other/0", "completion": ""}), (3, {"task_id": "HumanEval/0", "completion": ""})]
    with pytest.raises(ProblemsError, match=r"s.jsonl: 1 sample\(s\) are for tasks not among the python problems "
                       r"\(the default ones\), first Other/0 \(line 1\): pass the --language and --problems they "
                       r"were generated for, or --skip-unknown-tasks"):
        tool.known_samples(tool.parse_args(["--samples", "s.jsonl"]), numbered, problems)
    args = tool.parse_args(["--samples", "s.jsonl", "--skip-unknown-tasks"])
    assert tool.known_samples(args, numbered, problems) == ([numbered[1][1]], 1) and args.scoring == "strict"
    with pytest.raises(SystemExit) as stop:
        tool.parse_args(["--canonical", "--skip-unknown-tasks"])
    assert stop.value.code == 2 and "--skip-unknown-tasks: only with --samples" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A random 2-layer model saved at iteration 42, and two short problems it can be prompted with."""
    import codegeex_train.generation  # noqa: F401  (fails, not skips, when generation is missing)
    from codegeex_train.checkpoint import save_model_checkpoint, split_state_dict
    from codegeex_train.tokenization.tokenizer import default_tokenizer
    from codegeex_train.model import CodeGeeXModel, ModelConfig

    root = tmp_path_factory.mktemp("ckpt")
    config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=default_tokenizer().vocab_size,
                         max_position_embeddings=64, init_method_std=0.2)
    state = CodeGeeXModel(config, None, None, seed=3).state_dict()
    save_model_checkpoint(root / "ckpt", split_state_dict(state, config, 1), config, 1, tag="iter_0000042",
                          iteration=42)
    problems = [{"task_id": f"Tiny/{i}", "prompt": f"def f{i}(a, b):\n", "entry_point": f"f{i}",
                 "test": "def check(c):\n    assert c(1, 2) == 3\n", "canonical_solution": "    return a + b\n"}
                for i in range(2)]
    write_jsonl(root / "problems.jsonl", problems)
    return root


def test_generate_from_a_checkpoint_and_score(tiny_checkpoint, tmp_path):
    """--load: the samples (decoded 2 rows at a time, executed as they come) are the generator's own for the seed,
    as it gives them with all rows together; the record holds pass@k and the timings."""
    root = tiny_checkpoint
    result = run_tool("--load", root / "ckpt", "--problems", root / "problems.jsonl", "--num-samples-per-task", 3,
                      "--temperature", "0.8", "--max-new-tokens", 8, "--k", "1,2", "--device", "cpu",
                      "--output", tmp_path / "results.jsonl", "--run-dir", tmp_path / "run", "--workers", 2,
                      "--timeout", 20, "--batch-size", 2, "--seed", 9)
    assert result.returncode == 0, result.stderr
    results = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [(r["task_id"], r["sample"]) for r in results] == [(f"Tiny/{i}", j) for i in range(2) for j in range(3)]
    assert all(isinstance(r["completion"], str) and r["result"] for r in results)
    from codegeex_train.tokenization.tokenizer import default_tokenizer
    from codegeex_train.evaluation import default_params
    from codegeex_train.generation import Generator

    problems = read_problems(root / "problems.jsonl")
    expected = Generator.from_checkpoint(root / "ckpt", default_tokenizer()).generate(
        [p["prompt"] for p in problems.values()], default_params(3, max_new_tokens=8, temperature=0.8, seed=9),
        num_samples=3)
    assert [r["completion"] for r in results] == expected
    [record] = read_metrics(tmp_path / "run")
    assert record["iteration"] == 42 and record["split"] == "humaneval"
    assert set(record) == {"iteration", "split", "humaneval_pass@1", "humaneval_pass@2", "humaneval_tasks",
                           "humaneval_samples_per_task", "scoring", "humaneval_generation_seconds",
                           "humaneval_execution_seconds", "humaneval_execution_tail_seconds",
                           "humaneval_sandbox_seconds"}
    assert "pass@1:" in result.stdout and "pass@2:" in result.stdout
    assert "python: generation " in result.stderr and " of it after generation" in result.stderr
