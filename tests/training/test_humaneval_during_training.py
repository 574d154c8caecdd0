"""--eval-humaneval-interval: greedy pass@1 on the first K HumanEval problems, logged during training."""

import pytest

from codegeex_train import pretrain
from codegeex_train.testing import metrics_records, run_distributed, run_pretrain, tiny_pretrain_args


def test_pass_at_1_is_logged_at_the_interval(tmp_path, tiny_data):
    save = str(tmp_path / "run")
    # TP 2 x DP 2: DP rank 0's TP group generates (collective over TP), the logging rank executes.
    run_distributed(run_pretrain, world_size=4, tp_size=2, deadline_s=600,
                    argv=tiny_pretrain_args(tiny_data, save, 4, "--tensor-model-parallel-size", "2",
                                   "--eval-humaneval-interval", "2", "--eval-humaneval-tasks", "2",
                                   "--eval-humaneval-max-new-tokens", "8", "--max-position-embeddings", "256"))
    rows = metrics_records(save, "humaneval")
    assert sorted(rows) == [2, 4]
    for row in rows.values():
        assert row["humaneval_tasks"] == 2 and row["humaneval_samples_per_task"] == 1
        assert row["humaneval_pass@1"] == 0.0  # a 4-iteration random model solves nothing
    assert sorted(metrics_records(save)) == [1, 2, 3, 4]  # training went on around the evaluations


def test_needs_a_single_pipeline_stage(tiny_data, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit):
        pretrain.main(tiny_pretrain_args(tiny_data, "unused", 4, "--pipeline-model-parallel-size", "2",
                                "--eval-humaneval-interval", "2"))
    assert "--eval-humaneval-interval needs --pipeline-model-parallel-size 1" in capsys.readouterr().err
