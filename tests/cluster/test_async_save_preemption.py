"""--async-save when a cluster kills or preempts the job while a checkpoint is being written in the background, through
`bash scripts/pretrain_codegen.sh` at PP 2 as test_failures.py runs it (each file write made slow by a test-only
variable, so the write is in flight when the test strikes). One directory, two launches: kill -9 of a rank leaves
`latest` at the previous complete checkpoint; the relaunch resumes from it, and SIGTERM to every process of that job
lets the checkpoint being written complete and become `latest`, every rank exits 0 and so does the script. The
relaunch runs again the iterations after that checkpoint that the killed launch ran uninterrupted: their losses equal
bit for bit (what it resumed is exactly the state saved; exact resume itself: tests/training/test_pretrain.py), and
the checkpoint completed under SIGTERM is whole: every file loads, both stages' weights and ZeRO partitions there.
The slow tier: about 50 s here."""

import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from launch_helpers import (
    finish,
    rank_pids,
    reaped_exit_codes,
    reaped_exit_codes_reporter,
    script_env,
    start_script,
    stop_session,
    train_losses,
)

from codegeex_train.checkpoint.async_save import TEST_SLOW_WRITE_ENV
from tests.harness import free_port

pytestmark = pytest.mark.slow

ITERS = 20
SAVES = ["--save-interval", "4", "--async-save"]
PP2 = {"PP": "2"}
SLOW = {TEST_SLOW_WRITE_ENV: "2"}  # 2 s before each file: a rank's two files of a save are in flight for ~4 s


def first_logged_iteration(log: str) -> int:
    return int(re.search(r" iteration +(\d+)/", log).group(1))


def write_in_flight(out: Path, tag: str, proc, timeout: float = 240) -> str:
    """Block until the ranks have begun writing ``tag`` (DeepSpeed created its directory); returns what ``latest``
    names then (an earlier tag: the write cannot be complete yet)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (out / tag).is_dir():
            latest = (out / "latest").read_text()
            assert latest != tag, "the write was complete already: it was not in flight"
            return latest
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (code {proc.returncode}) before {tag}:\n{proc.stdout.read()[-4000:]}")
        time.sleep(0.01)
    raise AssertionError(f"no {tag} within {timeout:.0f} s")


def launch_until(env, out, tag, strike) -> tuple[object, str, str]:
    """Launch, strike(proc) while ``tag`` is being written; returns (proc, latest at the strike, the log)."""
    proc = start_script(env, *SAVES)
    try:
        latest = write_in_flight(out, tag, proc)
        strike(proc)
        log = finish(proc, timeout=120)
    finally:
        stop_session(proc)
    return proc, latest, log


def checkpoint_tensors(directory: Path) -> dict[str, object]:
    """Every .pt file of a tag directory, loaded, by name."""
    return {p.name: torch.load(p, map_location="cpu", weights_only=False) for p in sorted(directory.glob("*.pt"))}


def test_kill_and_preemption_while_a_checkpoint_is_written(tmp_path, tiny_data):
    out = tmp_path / "run"
    env = script_env(out, tiny_data, train_iters=ITERS, PYTHONPATH=reaped_exit_codes_reporter(tmp_path / "site"),
                     **PP2, **SLOW)

    # 1. kill -9 of one rank while iter_0000008 is written: the job goes down, `latest` stays at iter_0000004.
    proc, latest, log = launch_until(env, out, "iter_0000008", lambda p: os.kill(rank_pids(str(out))[1], signal.SIGKILL))
    assert latest == "iter_0000004"  # committed before the next save began: at most one in flight
    assert proc.returncode != 0, log[-3000:]
    assert (out / "latest").read_text() == "iter_0000004"  # never the partial iter_0000008
    uninterrupted = train_losses(out)  # iterations 1 .. the kill (8 was logged before its save began)
    assert set(range(1, 9)) <= set(uninterrupted), sorted(uninterrupted)

    # 2. The relaunch resumes from iter_0000004; SIGTERM to every process of the job while iter_0000012 is written.
    env["LAUNCHER_ARGS"] = f"--master_addr 127.0.0.1 --master_port {free_port()}"
    pids, signalled = {}, []

    def preempt(p):
        pids.update(rank_pids(str(out)))
        signalled.append(time.monotonic())
        os.killpg(p.pid, signal.SIGTERM)

    proc, latest, log = launch_until(env, out, "iter_0000012", preempt)
    took = time.monotonic() - signalled[0]
    assert first_logged_iteration(log) == 5
    assert latest == "iter_0000008"
    assert proc.returncode == 0, log[-3000:]
    assert (out / "latest").read_text() == (out / "preempted").read_text() == "iter_0000012"  # it completed
    stopped_at = max(train_losses(out))  # the relaunch's last record
    assert (f"SIGTERM received (--exit-signal-handler): stopping after iteration {stopped_at}; saved iter_0000012"
            in log), log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    assert {reaped_exit_codes(log).get(pid) for pid in pids.values()} == {"0"}, (pids, log[-3000:])
    assert took < 30, took  # within the launcher's kill window

    resumed = train_losses(out)  # the relaunch's records come last and win
    assert sorted(resumed) == list(range(1, stopped_at + 1))
    rerun = [it for it in uninterrupted if it > 4]  # run by the killed launch from iteration 1, again by the relaunch
    for it in rerun:
        assert resumed[it] == uninterrupted[it], it  # bitwise: the relaunch resumed exactly the saved state
    # The checkpoint completed under SIGTERM is whole: every file loads, each stage's weights (of iteration 12) and
    # its ZeRO partition are there.
    files = checkpoint_tensors(out / "iter_0000012")
    models = [state for name, state in files.items() if name.endswith("model_states.pt")]
    partitions = [state for name, state in files.items() if name.endswith("optim_states.pt")]
    assert len(models) == len(partitions) == 2, list(files)
    for state in models:
        assert state["codegeex_train"]["iteration"] == 12 and state["module"], list(state)
    for state in partitions:
        assert state["optimizer_state_dict"]["single_partition_of_fp32_groups"], list(state["optimizer_state_dict"])
