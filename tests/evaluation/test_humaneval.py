"""``evaluate_humaneval`` end to end with a fake generator: prompts go in, completions come back (in the order
they finish), each is executed while the next are generated, they are scored, and the metrics are ready for
metrics.jsonl. The seeds are checked on a tiny real model."""

import dataclasses
import json
import threading
from dataclasses import dataclass

import pytest

from codegeex_train.evaluation import (
    HUMANEVAL_STOP,
    Sandbox,
    SandboxConfig,
    evaluate_humaneval,
    evaluate_samples,
    generate_samples,
    log_humaneval_metrics,
    read_problems,
    select_tasks,
)
from codegeex_train.evaluation.humaneval import evaluate_generated
from tests.harness import read_metrics

TIMINGS = {"generation_seconds", "execution_seconds", "execution_tail_seconds", "sandbox_seconds"}


@dataclass(frozen=True)
class Params:  # the fields of codegeex_train.generation.SamplingParams
    max_new_tokens: int = 300
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 1234
    stop: tuple = HUMANEVAL_STOP


class FakeGenerator:
    """Answers each prompt with its canonical solution, or ``body`` for the (task, sample) pairs in ``wrong`` (a
    task alone: all its samples); yields the samples last first. With ``wait_for``, it yields the rest only once
    that event is set (by the sandbox, once a sample has run)."""

    def __init__(self, problems, wrong=(), wait_for: threading.Event | None = None, body="    return None\n"):
        self.by_prompt = {p["prompt"]: (task, p["canonical_solution"]) for task, p in problems.items()}
        self.wrong, self.wait_for, self.body = set(wrong), wait_for, body
        self.calls = []

    def stream(self, prompts, params, *, num_samples=1, batch_size=None):
        self.calls.append((len(prompts), num_samples, batch_size, params.seed))
        for k, index in enumerate(reversed(range(len(prompts) * num_samples))):
            if k == 1 and self.wait_for is not None:
                assert self.wait_for.wait(30), "no sample was executed while the generator was still generating"
            task, solution = self.by_prompt[prompts[index // num_samples]]
            wrong = task in self.wrong or (task, index % num_samples) in self.wrong
            yield index, self.body if wrong else solution


class Watched:
    """A sandbox that records the programs it ran and sets ``ran`` once it has run one."""

    def __init__(self, sandbox):
        self.sandbox, self.ran, self.programs = sandbox, threading.Event(), []

    def __getattr__(self, name):
        return getattr(self.sandbox, name)

    def run(self, program, **kwargs):
        result = self.sandbox.run(program, **kwargs)
        self.programs.append(program)
        self.ran.set()
        return result


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
    timings = {key.removeprefix("humaneval_"): metrics.pop(key) for key in list(metrics) if key.endswith("seconds")}
    assert metrics == {"humaneval_pass@1": 0.75, "humaneval_tasks": 4, "humaneval_samples_per_task": 1}
    assert set(timings) == TIMINGS and all(t >= 0 for t in timings.values())
    results = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [(r["task_id"], r["passed"]) for r in results] == [
        ("HumanEval/0", True), ("HumanEval/1", False), ("HumanEval/2", True), ("HumanEval/3", True)]
    assert results[1]["result"].startswith("failed: ") and results[1]["completion"] == "    return None\n"
    assert set(results[0]) == {"task_id", "sample", "completion", "passed", "result"}


def test_n_samples_per_task_in_one_stream(problems, sandbox):
    """All tasks' prompts in one stream call (continuous batching across tasks), the seed as given: the generator
    seeds each sample from (seed, task, sample) itself."""
    generator = FakeGenerator(problems)
    metrics = evaluate_humaneval(generator, problems, tasks=3, num_samples=4, params=Params(temperature=0.8, seed=7),
                                 batch_size=5, ks=(1, 2, 10), sandbox=sandbox)
    assert generator.calls == [(3, 4, 5, 7)]
    assert {k: v for k, v in metrics.items() if not k.endswith("seconds")} == {
        "humaneval_pass@1": 1.0, "humaneval_pass@2": 1.0, "humaneval_tasks": 3,
        "humaneval_samples_per_task": 4}  # pass@10 needs 10 samples per task


def test_execution_overlaps_generation_with_the_same_records(problems, sandbox):
    """The generator yields its second sample only once the sandbox has run one: it finishes only if samples
    execute while it generates. The records and pass@k are those of generating first and executing after."""
    tasks = select_tasks(problems, 3)
    wrong = {("HumanEval/0", 1), "HumanEval/2"}
    params = Params(temperature=0.8)
    watched = Watched(sandbox)
    overlapped = evaluate_generated(FakeGenerator(tasks, wrong, wait_for=watched.ran), tasks, num_samples=2,
                                    params=params, sandbox=watched, ks=(1, 2))
    samples = generate_samples(FakeGenerator(tasks, wrong), tasks, num_samples=2, params=params)
    sequential = evaluate_samples(tasks, samples, ks=(1, 2), sandbox=sandbox)
    assert overlapped.results == sequential.results and overlapped.pass_at_k == sequential.pass_at_k
    assert [(r["task_id"], r["sample"], r["passed"]) for r in overlapped.results] == [
        ("HumanEval/0", 0, True), ("HumanEval/0", 1, False), ("HumanEval/1", 0, True), ("HumanEval/1", 1, True),
        ("HumanEval/2", 0, False), ("HumanEval/2", 1, False)]
    t = overlapped.timing
    assert set(t) == TIMINGS and sequential.timing is None
    # A sample finished before generation did, so execution began well before generation's end.
    assert 0 <= t["execution_tail_seconds"] < t["execution_seconds"] and t["sandbox_seconds"] > 0
    assert t["generation_seconds"] > t["execution_seconds"] - t["execution_tail_seconds"]


def test_a_sample_timed_out_alongside_cpu_decoding_runs_again(problems):
    """Decoding on the CPUs can starve a sample of its time limit: one that times out while a generator on "cpu"
    still decodes runs again once decoding is over (the record is then that of executing after). Not so for a
    generator elsewhere."""
    tasks = select_tasks(problems, 2)
    looping = "    while True:\n        pass\n"
    with Sandbox(SandboxConfig(timeout=1.0), workers=2) as quick:
        for device, runs in (("cpu", 2), ("cuda", 1)):
            watched = Watched(quick)
            generator = FakeGenerator(tasks, wrong={"HumanEval/1"}, wait_for=watched.ran, body=looping)
            generator.device = device  # the looping sample comes first and times out before decoding ends
            evaluation = evaluate_generated(generator, tasks, num_samples=1, params=Params(), sandbox=watched, ks=(1,))
            assert evaluation.results[1]["result"] == "timed out"
            assert sum(looping in program for program in watched.programs) == runs, device


def test_generate_only_on_ranks_that_do_not_execute(problems):
    generator = FakeGenerator(problems)
    assert evaluate_humaneval(generator, problems, tasks=2, params=Params(), execute=False) is None
    assert generator.calls == [(2, 1, None, 1234)]


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


def test_samples_depend_on_the_seed_not_the_batch_size():
    """A tiny real generator: task i's sample j draws from row_seed(seed, i, j), so a rerun gives the same samples,
    so does any batch size, and they equal the no-cache reference decoder's (its own code path, same streams)."""
    from codegeex_train.tokenization.tokenizer import default_tokenizer
    from codegeex_train.generation import Generator, SamplingParams, truncate_at_stop
    from codegeex_train.model import CodeGeeXModel, ModelConfig

    tokenizer = default_tokenizer()
    config = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=tokenizer.vocab_size,
                         max_position_embeddings=64, init_method_std=0.2)
    generator = Generator(CodeGeeXModel(config, None, None, seed=3), tokenizer)
    tasks = {f"Tiny/{i}": {"prompt": prompt} for i, prompt in enumerate(["def add(a, b):\n", "x = [", "# sort\n"])}
    params = SamplingParams(max_new_tokens=6, temperature=0.8, top_p=0.95, seed=5, stop=HUMANEVAL_STOP)
    first = generate_samples(generator, tasks, num_samples=3, params=params, batch_size=4)
    assert [s["task_id"] for s in first] == [task for task in tasks for _ in range(3)]
    assert len({s["completion"] for s in first[:3]}) > 1  # the samples of one task differ
    # A rerun, all 9 rows in one batch this time: the same samples.
    assert generate_samples(generator, tasks, num_samples=3, params=params) == first
    prompt_ids = tokenizer.encode_batch([p["prompt"] for p in tasks.values()])
    reference = generator.generate_ids(prompt_ids, params, num_samples=3, use_cache=False)
    assert [s["completion"] for s in first] == [
        truncate_at_stop(generator.completion_text(prompt_ids[k // 3], ids), params.stop)
        for k, ids in enumerate(reference)]
    one_task = dict(list(tasks.items())[:1])  # task 0 again: its place, so its streams, are the same
    assert generate_samples(generator, one_task, num_samples=3, params=params) == first[:3]
    assert generate_samples(generator, one_task, num_samples=3, params=dataclasses.replace(params, seed=6)) != first[:3]
