"""The entry point under the real launchers (the only tests that do not spawn ranks in-process)."""

import os
import sys

import pytest

from tests.harness import free_port, read_metrics, run_process_group

pytestmark = pytest.mark.slow  # every test in this file is in the slow tier (tests/conftest.py)


def test_torchrun_two_ranks(tmp_path, tiny_data):
    save = tmp_path / "torchrun"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "codegeex_train.pretrain", "--tensor-model-parallel-size", "2", "--num-layers", "2",
           "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings",
           "64", "--micro-batch-size", "2", "--train-iters", "2", "--log-interval", "1", "--eval-iters", "1",
           "--data-path", tiny_data, "--split", "90,9,1", "--save", str(save), "--no-progress-bar"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = run_process_group(cmd, capture_output=True, text=True, timeout=300, env=env)  # a timeout kills the ranks too
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "iteration        2/       2" in out.stdout
    # rank 0's start-up lines: logged under the package's logger name although pretrain runs as __main__
    assert sum(line.startswith("model: ") for line in out.stdout.splitlines()) == 1, out.stdout[-3000:]
    rows = read_metrics(save)
    assert [r["iteration"] for r in rows if r["split"] == "train"] == [1, 2]
    assert (save / "latest").read_text() == "iter_0000002"
