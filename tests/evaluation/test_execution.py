"""The HumanEval harness scores canonical solutions 1 and wrong ones 0; a sample that loops, allocates without
bound, forks, deletes files outside its scratch directory, opens a socket or exits early is stopped and
counted as failed while the harness goes on; and the kernel-level guards hold without the Python ones."""

import os
import socket
import time

import pytest

from codegeex_train.evaluation import (Sandbox, SandboxConfig, estimate_pass_at_k, evaluate_samples, read_problems,
                                       select_tasks)
from codegeex_train.evaluation.sandbox import _lock_uid, _proc_tasks

ROOT = os.geteuid() == 0


@pytest.fixture(scope="module")
def problems():
    return read_problems()


@pytest.fixture(scope="module")
def scoring_sandbox():
    # A generous time limit: these samples are all quick, and a loaded CI machine must not fail them.
    return Sandbox(SandboxConfig(timeout=20.0), workers=2)


def test_canonical_solutions_of_all_164_problems_pass(problems, scoring_sandbox):
    samples = [{"task_id": task, "completion": p["canonical_solution"]} for task, p in problems.items()]
    start = time.monotonic()
    evaluation = evaluate_samples(problems, samples, sandbox=scoring_sandbox)
    print(f"164 canonical solutions on {scoring_sandbox.workers} workers: {time.monotonic() - start:.1f} s")
    failures = [(r["task_id"], r["result"]) for r in evaluation.results if not r["passed"]]
    assert not failures
    assert evaluation.pass_at_k == {1: 1.0}
    assert evaluation.metrics() == {"humaneval_pass@1": 1.0, "humaneval_tasks": 164, "humaneval_samples_per_task": 1}
    assert all(r["result"] == "passed" for r in evaluation.results)


def test_wrong_completions_score_zero(problems, scoring_sandbox):
    subset = {task: p for i, (task, p) in enumerate(problems.items()) if i % 4 == 0}  # 41 tasks across the set
    samples = [{"task_id": task, "completion": "    return None\n"} for task in subset]
    evaluation = evaluate_samples(subset, samples, sandbox=scoring_sandbox)
    assert evaluation.pass_at_k == {1: 0.0}
    assert all(r["result"].startswith("failed: ") for r in evaluation.results), evaluation.results


def _canonical_body(problems, task):
    return problems[task]["canonical_solution"]


def _listener():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.2)
    return server


def _accepted_any(server) -> bool:
    try:
        connection, _ = server.accept()
        connection.close()
        return True
    except (socket.timeout, BlockingIOError):
        return False


def _live_sample_processes(sandbox) -> list[int]:
    return [pid for uid in sandbox.sample_uids for pid in _proc_tasks(uid)[0]]


def _misbehaving(problems, task, sentinel, port):
    """(name, completion): each would pass if its guard failed (the function is correct, the mischief is extra
    top-level code), so "not passed" shows the guard held."""
    body = _canonical_body(problems, task)
    return [
        ("good", body),
        ("loops forever", "    while True:\n        pass\n"),
        ("allocates without bound", "    chunks = []\n    while True:\n        chunks.append(bytearray(8 << 20))\n"),
        # Bounded: 200 children that sleep, so a failed guard costs 200 processes, never the machine.
        ("forks", body + "\nimport os, time\nfor _ in range(200):\n    if os.fork() == 0:\n        time.sleep(60)\n"
                         "        os._exit(0)\n"),
        ("deletes a file outside scratch", body + f"\nimport os\nos.remove({str(sentinel)!r})\n"),
        ("removes a tree outside scratch", body + f"\nimport shutil\nshutil.rmtree({str(sentinel.parent)!r})\n"),
        ("opens a socket", body + f"\nimport socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n"),
        ("exits before the tests", body + "\nimport sys\nsys.exit(0)\n"),
        ("good again", body),
    ]


def test_misbehaving_samples_are_stopped_and_the_harness_goes_on(problems, tmp_path):
    task = "HumanEval/0"
    sentinel = tmp_path / "outside" / "sentinel.txt"
    sentinel.parent.mkdir()
    sentinel.write_text("keep me")
    scratch_root = tmp_path / "scratch"
    scratch_root.mkdir()
    server = _listener()
    cases = _misbehaving(problems, task, sentinel, server.getsockname()[1])
    sandbox = Sandbox(SandboxConfig(timeout=2.0, memory_mb=256, scratch_root=str(scratch_root)), workers=2)
    start = time.monotonic()
    evaluation = evaluate_samples({task: problems[task]}, [{"task_id": task, "completion": c} for _, c in cases],
                                  sandbox=sandbox)
    elapsed = time.monotonic() - start
    outcome = {name: r["result"] for (name, _), r in zip(cases, evaluation.results)}
    print(outcome, f"{elapsed:.1f} s")
    assert outcome.pop("good") == "passed" and outcome.pop("good again") == "passed", outcome
    assert outcome["loops forever"] == "timed out"
    assert outcome["allocates without bound"] in ("failed: MemoryError", "timed out")
    assert outcome["exits before the tests"] == "failed: SystemExit: 0"
    for name in ("forks", "deletes a file outside scratch", "removes a tree outside scratch", "opens a socket"):
        assert outcome[name].startswith("failed: "), (name, outcome[name])
    assert sentinel.read_text() == "keep me"
    assert not _accepted_any(server)
    assert evaluation.pass_at_k[1] == pytest.approx(estimate_pass_at_k(len(cases), 2, 1))
    assert list(scratch_root.iterdir()) == []  # every scratch directory deleted
    assert _live_sample_processes(sandbox) == []
    assert elapsed < 30


def test_kernel_guards_hold_without_the_python_ones(problems, tmp_path):
    """With the Python-level guards off, what the kernel enforces alone: the process limit, the network
    namespace and (as root) the sample's own unprivileged uid."""
    sandbox = Sandbox(SandboxConfig(timeout=3.0, memory_mb=256, python_guards=False), workers=2)
    print(sandbox.guards)
    task = "HumanEval/0"
    body = _canonical_body(problems, task)
    sentinel = tmp_path / "outside" / "sentinel.txt"
    sentinel.parent.mkdir()
    sentinel.write_text("keep me")
    server = _listener()
    cases = [("good", body)]
    uid_isolated = bool(sandbox.sample_uids)
    if uid_isolated or not ROOT:  # root without a uid of its own: the kernel does not limit its processes
        cases.append(("forks", _misbehaving(problems, task, sentinel, 0)[3][1]))
    if uid_isolated:  # as another user, a sample may delete that user's files and signal the harness
        cases += [
            ("deletes a file outside scratch", body + f"\nimport os\nos.remove({str(sentinel)!r})\n"),
            ("kills the harness", body + "\nimport os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n"
                                         f"os.kill({os.getpid()}, signal.SIGKILL)\n"),
            # Leaves its process group: the sweep of the sample's uid still kills it.
            ("escapes and lingers", body + "\nimport os, time\nif os.fork() == 0:\n    os.setsid()\n"
                                           "    time.sleep(120)\n    os._exit(0)\n"),
        ]
    if sandbox.network_namespace:
        cases.append(("opens a socket", body + "\nimport socket\nsocket.create_connection(('127.0.0.1', "
                                               f"{server.getsockname()[1]}), timeout=2)\n"))
    cases.append(("good again", body))
    evaluation = evaluate_samples({task: problems[task]}, [{"task_id": task, "completion": c} for _, c in cases],
                                  sandbox=sandbox)
    outcome = {name: r["result"] for (name, _), r in zip(cases, evaluation.results)}
    print(outcome)
    assert outcome.pop("good") == "passed" and outcome.pop("good again") == "passed", outcome
    if "forks" in outcome:
        assert "Resource temporarily unavailable" in outcome.pop("forks")  # RLIMIT_NPROC
    if uid_isolated:
        assert "Permission denied" in outcome.pop("deletes a file outside scratch")
        assert "Operation not permitted" in outcome.pop("kills the harness")
        assert outcome.pop("escapes and lingers") == "passed"  # a correct program; what it left is killed
        assert _live_sample_processes(sandbox) == []
    if "opens a socket" in outcome:
        assert "Network is unreachable" in outcome.pop("opens a socket")
    assert not outcome
    assert sentinel.read_text() == "keep me"
    assert not _accepted_any(server)


def test_guards_are_reported(scoring_sandbox):
    guards = scoring_sandbox.guards
    assert set(guards) == {"time", "memory", "scratch", "processes", "files", "network"}
    assert "RLIMIT_AS 2048 MiB" in guards["memory"]
    if ROOT and scoring_sandbox.sample_uids:
        assert "own uid (kernel)" in guards["processes"]
    assert ("network namespace" in guards["network"]) == scoring_sandbox.network_namespace


def test_a_pass_needs_the_program_to_finish():
    sandbox = Sandbox(SandboxConfig(timeout=5.0), workers=1)
    assert sandbox.run("x = 1\n").result == "passed"
    assert sandbox.run("import os\nos._exit(0)\n").result == "failed: exited before the tests finished"
    assert sandbox.run("raise ValueError('nope')\n").result == "failed: ValueError: nope"
    assert sandbox.run("assert 1 == 2\n").result == "failed: AssertionError"
    assert sandbox.run("def f(:\n").result.startswith("failed: SyntaxError")
    assert sandbox.run("import os\nassert 'HOME' in os.environ and not os.listdir('.')\n"
                       "assert os.environ.keys() <= {'PATH', 'HOME', 'TMPDIR', 'LANG', 'LC_CTYPE'}\n").passed
    assert sandbox.run("open('x.txt', 'w').write('inside scratch is fine')\nimport os\nos.remove('x.txt')\n").passed
    assert sandbox.run("import os, shutil, tempfile\nos.makedirs('d/e')\nopen('d/e/f', 'w').close()\n"
                       "shutil.rmtree('d')\ntempfile.NamedTemporaryFile().close()\nimport socket\n").passed


@pytest.mark.parametrize("pidfd", [True, False])
def test_waiting_leaves_the_process_unreaped(monkeypatch, pidfd):
    import subprocess

    from codegeex_train.evaluation.sandbox import _wait_unreaped

    if not pidfd:
        monkeypatch.delattr(os, "pidfd_open", raising=False)
    slow = subprocess.Popen(["sleep", "10"])
    try:
        start = time.monotonic()
        assert not _wait_unreaped(slow.pid, 0.3)
        assert 0.25 < time.monotonic() - start < 5
    finally:
        slow.kill()
        slow.wait()
    quick = subprocess.Popen(["true"])
    assert _wait_unreaped(quick.pid, 10)
    assert os.waitid(os.P_PID, quick.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None  # a zombie still
    assert quick.wait() == 0


def test_bad_configuration():
    with pytest.raises(ValueError):
        SandboxConfig(timeout=0)
    with pytest.raises(ValueError):
        SandboxConfig(memory_mb=0)
    with pytest.raises(ValueError):
        Sandbox(workers=0)


def test_select_tasks(problems):
    assert len(select_tasks(problems, 5)) == 5
    with pytest.raises(ValueError):
        select_tasks(problems, 0)
    with pytest.raises(ValueError):
        select_tasks(problems, 165)


@pytest.mark.skipif(not ROOT, reason="sample uids are used as root only")
def test_live_sandboxes_never_share_a_sample_uid(scoring_sandbox):
    if not scoring_sandbox.sample_uids:
        pytest.skip(f"this machine gives no sample uids: {scoring_sandbox.guards['processes']}")
    with Sandbox(SandboxConfig(timeout=5.0), workers=2) as other:
        assert other.sample_uids and not set(other.sample_uids) & set(scoring_sandbox.sample_uids)
        taken = other.sample_uids
        assert _lock_uid(taken[0]) is None  # reserved while the sandbox lives
    fd = _lock_uid(taken[0])  # and free again once it is closed
    assert fd is not None
    os.close(fd)
