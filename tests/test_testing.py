"""The test harness itself (tests/harness.py): what a rank returns comes back with every torch tensor turned
into a numpy array (a tensor sent as it is can vanish with its rank), and run_process_group kills a timed-out
command's whole process group, not only the command."""

import os
import select
import signal
import subprocess
from collections import namedtuple

import numpy as np
import pytest
import torch

from tests.harness import run_distributed, run_process_group

Pair = namedtuple("Pair", "left right")


def return_tensors(topo):
    """Tensors in every container a rank may return; the rank then exits at once (its shared memory with it)."""
    base = torch.arange(6.0).view(2, 3) + topo.rank
    weight = torch.nn.Parameter(base.clone())  # requires grad
    return {"plain": base, "nested": [base * 2, (base.long(), "text", 3)], "pair": Pair(base.bfloat16(), None),
            "grad": weight, "size": base.shape, "scalar": base.sum()}


def test_tensors_a_rank_returns_come_back_as_numpy():
    for rank, r in enumerate(run_distributed(return_tensors, world_size=2)):
        expected = np.arange(6.0).reshape(2, 3) + rank
        assert type(r["plain"]) is np.ndarray and r["plain"].dtype == np.float32
        assert np.array_equal(r["plain"], expected)
        doubled, (as_long, text, three) = r["nested"]
        assert np.array_equal(doubled, 2 * expected) and as_long.dtype == np.int64 and np.array_equal(as_long, expected)
        assert (text, three) == ("text", 3)
        assert isinstance(r["pair"], Pair) and r["pair"].right is None
        assert r["pair"].left.dtype == np.float32 and np.array_equal(r["pair"].left, expected)  # bfloat16 -> float32
        assert type(r["grad"]) is np.ndarray and np.array_equal(r["grad"], expected)
        assert r["size"] == (2, 3) and isinstance(r["size"], torch.Size)
        assert type(r["scalar"]) is np.ndarray and r["scalar"].shape == () and r["scalar"] == expected.sum()


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, killed and not yet reaped by its new parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _wait_gone(pid: int, timeout: float) -> bool:
    """Wait (on a pidfd: until it exits, not polling) up to ``timeout`` s for ``pid`` to stop running."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        select.select([pidfd], [], [], timeout)
    finally:
        os.close(pidfd)
    return not _alive(pid)


def _launcher_with_grandchild(pidfile):
    """A "launcher" that starts a background grandchild sleeping forever, writes its pid, and waits for it."""
    return ["bash", "-c", f"sleep infinity & echo $! > {pidfile}; wait"]


@pytest.mark.slow
def test_run_process_group_kills_the_grandchildren_on_timeout(tmp_path):
    # The problem: subprocess.run's timeout kills the launcher alone, and its ranks run on.
    control = tmp_path / "control.pid"
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run(_launcher_with_grandchild(control), timeout=2, stdout=subprocess.DEVNULL, check=False)
    orphan = int(control.read_text())
    try:
        assert _alive(orphan)
    finally:
        os.kill(orphan, signal.SIGKILL)
    # The helper: the whole process group goes, and the timeout (with what was printed) is raised.
    pidfile = tmp_path / "grandchild.pid"
    with pytest.raises(subprocess.TimeoutExpired) as timeout:
        run_process_group(_launcher_with_grandchild(pidfile), timeout=2, capture_output=True, text=True)
    grandchild = int(pidfile.read_text())
    try:
        assert _wait_gone(grandchild, timeout=5), f"grandchild {grandchild} outlived the timeout"
    finally:
        if _alive(grandchild):
            os.kill(grandchild, signal.SIGKILL)
    assert timeout.value.timeout == 2


def test_run_process_group_is_subprocess_run_otherwise(tmp_path):
    done = run_process_group(["bash", "-c", "echo out; echo err >&2; exit 3"], timeout=30, capture_output=True,
                             text=True, cwd=tmp_path)
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")
    with pytest.raises(subprocess.CalledProcessError):
        run_process_group(["false"], timeout=30, check=True)
    assert run_process_group(["cat"], timeout=30, input=b"in", capture_output=True).stdout == b"in"
