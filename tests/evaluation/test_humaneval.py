"""``evaluate_humaneval`` end to end with a fake generator (the real one is tested with the model): prompts go
in, completions come back, they are scored, and the metrics are ready for metrics.jsonl."""

import json
from dataclasses import dataclass

import pytest

from codegeex_train.evaluation import (
    HUMANEVAL_STOP,
    Sandbox,
    SandboxConfig,
    evaluate_humaneval,
    generate_samples,
    log_humaneval_metrics,
    read_problems,
    select_tasks,
)
from tests.harness import read_metrics


@dataclass(frozen=True)
class Params:  # the fields of codegeex_train.generation.SamplingParams
    max_new_tokens: int = 300
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 1234
    stop: tuple = HUMANEVAL_STOP


class FakeGenerator:
    """Answers each prompt with its canonical solution, or a wrong body for the tasks in ``wrong``."""

    def __init__(self, problems, wrong=()):
        self.by_prompt = {p["prompt"]: (task, p["canonical_solution"]) for task, p in problems.items()}
        self.wrong = set(wrong)
        self.calls = []

    def generate(self, prompts, params):
        self.calls.append((len(prompts), params.seed))
        out = []
        for prompt in prompts:
            task, solution = self.by_prompt[prompt]
            out.append("    return None\n" if task in self.wrong else solution)
        return out


@pytest.fixture(scope="module")
def problems():
    return read_problems()


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(SandboxConfig(timeout=20.0), workers=2) as sandbox:
        yield sandbox


def test_greedy_pass_at_1_on_the_first_tasks(problems, sandbox, tmp_path):
    generator = FakeGenerator(problems, wrong={"HumanEval/1"})
    metrics = evaluate_humaneval(generator, problems, tasks=4, params=Params(), sandbox=sandbox,
                                 output=tmp_path / "results.jsonl")
    assert metrics == {"humaneval_pass@1": 0.75, "humaneval_tasks": 4, "humaneval_samples_per_task": 1}
    results = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [(r["task_id"], r["passed"]) for r in results] == [
        ("HumanEval/0", True), ("HumanEval/1", False), ("HumanEval/2", True), ("HumanEval/3", True)]
    assert results[1]["result"].startswith("failed: ") and results[1]["completion"] == "    return None\n"
    assert set(results[0]) == {"task_id", "sample", "completion", "passed", "result"}


def test_n_samples_per_task_in_batches_with_a_seed_per_batch(problems, sandbox):
    generator = FakeGenerator(problems)
    metrics = evaluate_humaneval(generator, problems, tasks=3, num_samples=4, params=Params(temperature=0.8, seed=7),
                                 batch_size=5, ks=(1, 2, 10), sandbox=sandbox)
    assert generator.calls == [(5, 7), (5, 8), (2, 9)]  # 12 prompts
    assert metrics == {"humaneval_pass@1": 1.0, "humaneval_pass@2": 1.0, "humaneval_tasks": 3,
                       "humaneval_samples_per_task": 4}  # pass@10 needs 10 samples per task


def test_generate_only_on_ranks_that_do_not_execute(problems):
    generator = FakeGenerator(problems)
    assert evaluate_humaneval(generator, problems, tasks=2, params=Params(), execute=False) is None
    assert generator.calls == [(2, 1234)]


def test_greedy_with_several_samples_is_refused(problems):
    with pytest.raises(ValueError, match="greedy"):
        generate_samples(FakeGenerator(problems), select_tasks(problems, 1), num_samples=3, params=Params())


def test_default_sampling_parameters():
    pytest.importorskip("codegeex_train.generation")
    from codegeex_train.evaluation import default_params

    greedy = default_params(1)
    assert greedy.temperature == 0.0 and tuple(greedy.stop) == HUMANEVAL_STOP
    assert default_params(10).temperature == 0.8


def test_metrics_record_appended_to_the_run(tmp_path):
    metrics = {"humaneval_pass@1": 0.5, "humaneval_tasks": 2, "humaneval_samples_per_task": 1}
    log_humaneval_metrics(tmp_path, 100, metrics)
    log_humaneval_metrics(tmp_path, 200, metrics)
    lines = read_metrics(tmp_path)
    assert lines == [{"iteration": 100, "split": "humaneval", **metrics}, {"iteration": 200, "split": "humaneval",
                                                                            **metrics}]
