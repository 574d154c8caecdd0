"""--eval-humaneval-interval: greedy pass@1 on the first K HumanEval problems, logged during training."""

import pytest

from codegeex_train.generation import Generator
from tests.harness import fails_with, metrics_records, run_distributed, run_pretrain, tiny_pretrain_args

pytestmark = pytest.mark.slow  # every test in this file is in the slow tier (tests/conftest.py)

SOLVED = "HumanEval/1"  # of the 2 tasks evaluated, the one whose completion is replaced by its canonical solution


class OneSolvedGenerator(Generator):
    """The real generator (every TP rank generates, collectively), except that the completion of SOLVED's prompt
    is its canonical solution: the logged pass@1 must then be exactly 1/2, which no evaluation that skips
    generation or execution, or a trainer that drops the record, can log."""

    def stream(self, prompts, params, *, num_samples=1, batch_size=None):
        from codegeex_train.evaluation.problems import read_problems

        solved = read_problems()[SOLVED]
        assert prompts.count(solved["prompt"]) == 1, "SOLVED is not among the tasks evaluated"
        for index, completion in super().stream(prompts, params, num_samples=num_samples, batch_size=batch_size):
            yield index, solved["canonical_solution"] if prompts[index // num_samples] == solved["prompt"] else completion


def run_pretrain_one_solved(topology, argv):
    """run_pretrain with the HumanEval callback's Generator replaced by OneSolvedGenerator (in this rank)."""
    from codegeex_train.evaluation import during_training

    during_training.Generator = OneSolvedGenerator
    run_pretrain(topology, argv)


def test_pass_at_1_is_logged_at_the_interval(tmp_path, tiny_data):
    """pass@1 at iterations 2 and 4 is exactly 1/2: the random model's completion fails its task, the canonical
    solution passes its own."""
    save = str(tmp_path / "run")
    # TP 2 x DP 2: DP rank 0's TP group generates (collective over TP), the logging rank executes.
    run_distributed(run_pretrain_one_solved, world_size=4, tp_size=2, deadline_s=600,
                    argv=tiny_pretrain_args(tiny_data, save, 4, "--tensor-model-parallel-size", "2",
                                   "--eval-humaneval-interval", "2", "--eval-humaneval-tasks", "2",
                                   "--eval-humaneval-max-new-tokens", "8", "--max-position-embeddings", "256"))
    rows = metrics_records(save, "humaneval")
    assert sorted(rows) == [2, 4]
    for row in rows.values():
        assert row["humaneval_tasks"] == 2 and row["humaneval_samples_per_task"] == 1
        assert row["humaneval_pass@1"] == 0.5  # the random model solves nothing, the canonical solution its task
    assert sorted(metrics_records(save)) == [1, 2, 3, 4]  # training went on around the evaluations


def test_needs_a_single_pipeline_stage(tiny_data, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    save = tmp_path / "unused"
    fails_with(capsys, tiny_pretrain_args(tiny_data, str(save), 4, "--pipeline-model-parallel-size", "2",
                                          "--eval-humaneval-interval", "2"),
               "--eval-humaneval-interval needs --pipeline-model-parallel-size 1")
    assert not save.exists()  # refused before anything was written


def test_a_machine_that_cannot_isolate_samples_stops_the_run(tiny_data, capsys, monkeypatch, tmp_path):
    """No bubblewrap on PATH: one error line before anything starts, not a silent run without isolation;
    --unsafe-no-sandbox is the explicit way past it."""
    from codegeex_train.config.arguments import parse_args
    from codegeex_train.evaluation.during_training import training_sandbox

    monkeypatch.setenv("PATH", str(tmp_path))
    save = tmp_path / "unused"
    fails_with(capsys, tiny_pretrain_args(tiny_data, str(save), 4, "--eval-humaneval-interval", "2"),
               "error: --eval-humaneval-interval: bubblewrap (bwrap) not found: install bubblewrap",
               "--unsafe-no-sandbox")
    assert not save.exists()
    args = parse_args(tiny_pretrain_args(tiny_data, str(save), 4, "--eval-humaneval-interval", "2",
                                         "--unsafe-no-sandbox"))
    assert args.train.unsafe_no_sandbox
    assert training_sandbox(args.train.unsafe_no_sandbox).unsafe
