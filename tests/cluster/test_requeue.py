"""A requeued job (SLURM's --requeue, a crashed torchrun job started again): the same `torchrun -m
codegeex_train.pretrain ... --save RUN` command, with no --load and with retention on, run again after every process of
the first launch was killed with SIGKILL. It resumes from RUN's last checkpoint (issue 43: before, it started at
iteration 1 and retention then removed the run's checkpoints), and every loss, LR and gradient norm equals one
uninterrupted run of the command, bit for bit."""

import os
import signal
import sys

import pytest
from launch_helpers import TINY_MODEL

from codegeex_train.training.fault_injection import TEST_INJECT_ENV
from tests.harness import free_port, metrics_records, read_metrics, run_process_group

pytestmark = pytest.mark.slow  # every test in this file is in the slow tier (tests/conftest.py)

ITERS = 40


def command(save, data) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
            "--master_port", str(free_port()), "-m", "codegeex_train.pretrain", *TINY_MODEL, "--seq-length", "32",
            "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(ITERS), "--data-path", data,
            "--split", "90,9,1", "--num-workers", "0", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--save", str(save), "--save-interval", "2", "--keep-last-n-checkpoints", "1"]


def test_a_job_killed_with_sigkill_and_requeued_by_the_same_command_resumes_exactly(tmp_path, tiny_data):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    whole = run_process_group(command(tmp_path / "whole", tiny_data), timeout=600, env=env, capture_output=True,
                              text=True)
    assert whole.returncode == 0, whole.stderr[-4000:]

    run = tmp_path / "requeued"
    # The job (torchrun and both ranks) is killed with SIGKILL in iteration 11's forward, after the save of iteration
    # 10: no handler runs, nothing more is saved.
    killed = run_process_group(command(run, tiny_data), timeout=600, env={**env, TEST_INJECT_ENV: "kill-job@11"},
                               capture_output=True, text=True)
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr[-4000:])
    saved = 10
    assert (run / "latest").read_text() == f"iter_{saved:07d}"
    before = len(read_metrics(run))

    again = run_process_group(command(run, tiny_data), timeout=600, env=env, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-4000:]
    assert f"--save {run} holds a run (iter_{saved:07d}): resuming it" in again.stdout
    relaunched = [r["iteration"] for r in read_metrics(run)[before:] if r.get("split", "train") == "train"]
    assert relaunched == list(range(saved + 1, ITERS + 1))
    a, b = metrics_records(tmp_path / "whole"), metrics_records(run)
    for it in range(1, ITERS + 1):
        for key in ("loss", "lr", "grad_norm", "consumed_samples"):
            assert b[it][key] == a[it][key], (it, key)
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("iter_")) == [f"iter_{ITERS:07d}"]
