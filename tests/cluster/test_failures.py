"""What clusters do to long runs, through `bash scripts/pretrain_codegen.sh` as a user runs it (at PP 2, with the
script's one DataLoader worker per rank): a rank killed (relaunch resumes), preemption by SIGTERM to one rank or to
every process of the job (checkpoint, exit 0, resume), a wall-clock limit, a node that never joins. The kill and the
two preemptions strike one run in turn, in one directory; it is compared with one uninterrupted run of the same
command: every loss and the final weights bitwise equal."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from launch_helpers import (
    ROOT,
    final_weights,
    finish,
    job_processes,
    rank_pids,
    reaped_exit_codes,
    reaped_exit_codes_reporter,
    script_env,
    start_script,
    stop_session,
    train_losses,
    wait_for_latest,
)

from tests.harness import free_port

pytestmark = pytest.mark.slow  # every test in this file is in the slow tier (tests/conftest.py)

ITERS = 30
SAVE_EVERY = ["--save-interval", "5"]
PP2 = {"PP": "2"}  # where preemption was seen to fail: both ranks read data, each through its DataLoader worker


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_data):
    out = tmp_path_factory.mktemp("uninterrupted")
    proc = start_script(script_env(out, tiny_data, train_iters=ITERS, **PP2), *SAVE_EVERY)
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


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# A rank with the script's DataLoader (one worker), driven step by step by the test through stdin.
_LOADER_RANK = """
import sys, torch
from codegeex_train.data.sampler import build_pretraining_data_loader

loader = build_pretraining_data_loader([{"text": torch.full((3,), i)} for i in range(64)], 0, 2, 0, 1, num_workers=1)
it = iter(loader)
print(it._workers[0].pid, flush=True)
sys.stdin.readline()  # the test has sent the worker SIGTERM and SIGINT by now
print(*[int(next(it)["text"][0, 0]) for _ in range(len(loader))], it._workers[0].is_alive(), flush=True)
it._workers[0].terminate()  # SIGTERM from the rank itself: what DataLoader's shutdown and multiprocessing's exit do
it._workers[0].join(10)
print(it._workers[0].exitcode, flush=True)
it = iter(loader)
next(it)  # the worker is up (PyTorch's watchdog notes its parent once started: a rank killed before is not seen)
print(it._workers[0].pid, flush=True)
sys.stdin.readline()  # SIGKILLed here
"""


def test_loader_workers_leave_stop_signals_to_their_rank(tmp_path):
    """A worker ignores SIGTERM and SIGINT from others (a launcher's process-tree kill, SLURM, killpg) and goes on
    serving batches; its rank's SIGTERM still ends it at once (exit 0, as PyTorch's own handler does: an outright
    SIG_IGN would hang multiprocessing's exit, which terminates daemonic workers and then joins them); and it dies
    with its rank when the rank is SIGKILLed (the DataLoader's watchdog: within 5 s)."""
    rank = subprocess.Popen([sys.executable, "-c", _LOADER_RANK], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, cwd=tmp_path, start_new_session=True)
    try:
        worker = int(rank.stdout.readline())
        os.kill(worker, signal.SIGTERM)
        os.kill(worker, signal.SIGINT)
        time.sleep(0.5)
        rank.stdin.write("go\n")
        rank.stdin.flush()
        assert rank.stdout.readline().split() == [str(i) for i in range(0, 64, 2)] + ["True"]
        assert rank.stdout.readline().strip() == "0"  # ended by its rank's SIGTERM, at once and cleanly
        worker = int(rank.stdout.readline())
        rank.kill()
        rank.wait()
        deadline = time.monotonic() + 15
        while alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(worker), "a DataLoader worker outlived its SIGKILLed rank"
    finally:
        stop_session(rank)


def assert_stopped_by_signal(out, proc, log: str) -> int:
    """The job stopped on SIGTERM at its current iteration, saved it whole, and reported success; returns it."""
    assert proc.returncode == 0, log[-3000:]
    stopped_at = max(train_losses(out))  # the last iteration logged (a relaunch's come after a resumed one's)
    tag = f"iter_{stopped_at:07d}"
    assert (f"SIGTERM received (--exit-signal-handler): stopping after iteration {stopped_at}; saved {tag}"
            in log), log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    assert (out / "latest").read_text() == tag  # a checkpoint of the very iteration, not the last interval one
    assert (out / "preempted").read_text() == tag  # the ranks' word that it is complete: how the script says 0
    assert f"codegeex_train: stopped by a signal after saving {out}/{tag}" in log, log[-3000:]
    files = sorted(p.name for p in (out / tag).iterdir())
    assert sum(name.endswith("optim_states.pt") for name in files) == 2, files  # both stages' ZeRO partitions
    assert job_processes(str(out)) == [], "processes of the job left running"
    return stopped_at


def test_killed_rank_then_sigterm_to_one_rank_or_to_every_process_each_relaunch_resumes(tmp_path, tiny_data,
                                                                                     uninterrupted):
    """One directory, four launches of the same command. (1) kill -9 of one rank: the job goes down, no rank is left
    and the relaunch resumes from the last interval checkpoint. Preemption as it comes: (2) SIGTERM to one rank only
    (the ranks agree where to stop); (3) SIGTERM to every process of the job, as SLURM signals a job step (here
    `kill -- -PGID` of the script's session: the shell, tee, the `deepspeed` runner, the per-node launcher, the ranks
    and their DataLoader workers). Either way: the current iteration is saved, every rank exits 0, the script exits
    0. (4) runs to the end. Each relaunch goes on exactly as if uninterrupted: every loss and the final weights."""
    out = tmp_path / "struck"
    # The launcher, once signalled, collects the ranks' exit codes without printing them: make it print them.
    env = script_env(out, tiny_data, train_iters=ITERS, PYTHONPATH=reaped_exit_codes_reporter(tmp_path / "site"),
                     **PP2)

    # (1) kill -9, past the first interval checkpoint.
    proc = start_script(env, *SAVE_EVERY)
    try:
        saved = wait_for_latest(out, 5, proc)
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

    # (2), (3): the same command again finds OUTPUT_DIR/latest and resumes from there; SIGTERM mid-run, past an
    # interval checkpoint of this launch (`latest` must move on to the stop).
    stops, logs = [killed_at], []
    for whole_job in (False, True):
        env["LAUNCHER_ARGS"] = f"--master_addr 127.0.0.1 --master_port {free_port()}"
        proc = start_script(env, *SAVE_EVERY)
        try:
            wait_for_latest(out, (stops[-1] // 5 + 1) * 5, proc)
            pids = rank_pids(str(out))
            assert sorted(pids) == [0, 1], pids
            signalled = time.monotonic()
            if whole_job:
                os.killpg(proc.pid, signal.SIGTERM)
            else:
                os.kill(pids[1], signal.SIGTERM)
            log = finish(proc, timeout=120)
            took = time.monotonic() - signalled
        finally:
            stop_session(proc)
        stops.append(assert_stopped_by_signal(out, proc, log))
        logs.append(log)
        if whole_job:  # the launcher terminated the ranks (and exits 1): they had exited 0, before its 30-s SIGKILL
            codes = reaped_exit_codes(log)
            assert {codes.get(pids[0]), codes.get(pids[1])} == {"0"}, (pids, codes, log[-3000:])
            assert took < 30, took
            assert "Main process received SIGTERM" in log, log[-3000:]
        else:  # the launcher saw both ranks exit 0 itself
            for pid in pids.values():
                assert f"Process {pid} exits successfully." in log, log[-3000:]

    # (4) to the end.
    env["LAUNCHER_ARGS"] = f"--master_addr 127.0.0.1 --master_port {free_port()}"
    proc = start_script(env, *SAVE_EVERY)
    log = finish(proc)
    assert proc.returncode == 0, log[-4000:]
    logs.append(log)
    assert not (out / "preempted").exists()  # the run that went on from the stop removed the ranks' word for it
    # Each relaunch went on from where the one before stopped, and every loss equals the uninterrupted run's.
    assert [first_logged_iteration(text) for text in logs] == [stop + 1 for stop in stops]
    assert killed_at < stops[1] < stops[2] < ITERS
    resumed, full = train_losses(out), train_losses(uninterrupted)  # a relaunch's records come last and win
    assert sorted(resumed) == list(range(1, ITERS + 1))
    for it in range(1, ITERS + 1):
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
