"""What clusters do to long runs, through `bash scripts/pretrain_codegen.sh` as a user runs it: a rank killed
(relaunch resumes), preemption by SIGTERM (checkpoint, exit 0, resume), a wall-clock limit, a node that never
joins. Each comparison is with one uninterrupted run of the same command: final weights bitwise equal."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from launch_helpers import (
    ROOT,
    final_weights,
    finish,
    rank_pids,
    script_env,
    start_script,
    stop_session,
    train_losses,
    wait_for_latest,
)

from codegeex_train.testing import free_port

ITERS = 40
SAVE_EVERY = ["--save-interval", "5"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_data):
    out = tmp_path_factory.mktemp("uninterrupted")
    proc = start_script(script_env(out, tiny_data, train_iters=ITERS), *SAVE_EVERY)
    log = finish(proc)
    assert proc.returncode == 0, log[-4000:]
    return out


def first_logged_iteration(log: str) -> int:
    return int(re.search(r" iteration +(\d+)/", log).group(1))


def assert_same_final_weights(a, b):
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys()
    differing = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not differing, differing


def test_killed_rank_brings_job_down_and_relaunch_resumes(tmp_path, tiny_data, uninterrupted):
    out = tmp_path / "killed"
    env = script_env(out, tiny_data, train_iters=ITERS)
    proc = start_script(env, *SAVE_EVERY)
    try:
        saved = wait_for_latest(out, 10, proc)
        pids = rank_pids(str(out))
        assert sorted(pids) == [0, 1], pids
        os.kill(pids[1], signal.SIGKILL)
        log = finish(proc, timeout=120)
    finally:
        stop_session(proc)
    assert proc.returncode != 0, log[-3000:]
    # Shown: the killed rank's signal, or (when the launcher sees the survivor exit first) gloo's error naming it.
    assert "return code = -9" in log or "This is typically caused by a remote worker crashing" in log, log[-3000:]
    assert rank_pids(str(out)) == {}, "ranks left running after the job went down"
    killed_at = int((out / "latest").read_text().removeprefix("iter_"))
    assert saved <= killed_at < ITERS

    # The same command again: it finds OUTPUT_DIR/latest and resumes from there.
    env["LAUNCHER_ARGS"] = f"--master_addr 127.0.0.1 --master_port {free_port()}"
    proc = start_script(env, *SAVE_EVERY)
    log = finish(proc)
    assert proc.returncode == 0, log[-4000:]
    assert first_logged_iteration(log) == killed_at + 1
    resumed = train_losses(out)  # the relaunch's lines come last and win
    full = train_losses(uninterrupted)
    for it in range(killed_at + 1, ITERS + 1):
        assert resumed[it] == full[it], it
    assert_same_final_weights(uninterrupted, out)


def test_sigterm_saves_and_exits_zero_then_resumes(tmp_path, tiny_data, uninterrupted):
    out = tmp_path / "preempted"
    env = script_env(out, tiny_data, train_iters=ITERS)
    proc = start_script(env, *SAVE_EVERY)
    try:
        wait_for_latest(out, 5, proc)
        pids = rank_pids(str(out))
        os.kill(pids[1], signal.SIGTERM)  # one rank only: the ranks must still agree on where to stop
        log = finish(proc, timeout=120)
    finally:
        stop_session(proc)
    assert proc.returncode == 0, log[-3000:]
    assert "SIGTERM received" in log, log[-3000:]
    stopped_at = max(train_losses(out))
    assert stopped_at < ITERS
    assert (out / "latest").read_text() == f"iter_{stopped_at:07d}"  # a checkpoint of the very iteration
    files = sorted(p.name for p in (out / f"iter_{stopped_at:07d}").iterdir())
    assert sum(name.endswith("optim_states.pt") for name in files) == 2, files  # both ranks' ZeRO partitions

    env["LAUNCHER_ARGS"] = f"--master_addr 127.0.0.1 --master_port {free_port()}"
    proc = start_script(env, *SAVE_EVERY)
    log = finish(proc)
    assert proc.returncode == 0, log[-4000:]
    assert first_logged_iteration(log) == stopped_at + 1
    resumed, full = train_losses(out), train_losses(uninterrupted)
    assert sorted(resumed) == list(range(1, ITERS + 1))
    for it in range(stopped_at + 1, ITERS + 1):
        assert resumed[it] == full[it], it
    assert_same_final_weights(uninterrupted, out)


def test_exit_duration_stops_cleanly_with_a_checkpoint(tmp_path, tiny_data):
    out = tmp_path / "walltime"
    # 0.01 minutes have passed before the first iteration ends: it stops after iteration 1, everywhere.
    proc = start_script(script_env(out, tiny_data, train_iters=ITERS), "--exit-duration-in-mins", "0.01")
    log = finish(proc)
    assert proc.returncode == 0, log[-3000:]
    assert "--exit-duration-in-mins 0.01 reached: stopping after iteration 1" in log, log[-3000:]
    assert (out / "latest").read_text() == "iter_0000001"


def test_node_that_never_joins_ends_the_job_with_a_message(tmp_path, tiny_data):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("127.0.0.2 slots=2\n127.0.0.3 slots=2\n")
    timeout_min = 0.25
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--no_ssh", "--node_rank", "0", "--hostfile",
           str(hostfile), "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           str(ROOT / "codegeex_train" / "pretrain.py"), "--tensor-model-parallel-size", "2", "--num-layers", "2",
           "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings",
           "64", "--micro-batch-size", "2", "--train-iters", "2", "--data-path", tiny_data,
           "--distributed-timeout-minutes", str(timeout_min)]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log = finish(proc, timeout=180)
    finally:
        stop_session(proc)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert ("error: 2 of 4 ranks joined within --distributed-timeout-minutes 0.25; missing 127.0.0.3 (node 1): "
            "ranks 2, 3") in log, log[-3000:]
    # The timeout, plus start-up (imports, a launcher) on a busy 2-core machine: not the 10-minute default.
    assert timeout_min * 60 <= elapsed < timeout_min * 60 + 90, elapsed
