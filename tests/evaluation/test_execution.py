"""The HumanEval harness scores canonical solutions 1 and wrong ones 0; a sample that loops, allocates past its
memory limit, forks, deletes files outside its scratch directory, opens a socket or exits early is stopped and
counted as failed while the harness goes on, and nothing it started outlives it; each resource limit (address
space, file size, open files, CPU seconds) stops a sample with its own failure; and the kernel-level guards hold
without the Python ones."""

import os
import select
import socket
import time

import pytest

from codegeex_train.evaluation import (
    Sandbox,
    SandboxConfig,
    estimate_pass_at_k,
    evaluate_samples,
    read_problems,
    select_tasks,
)
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


def _sample_processes(scratch_root) -> list[int]:
    """Live (not zombie) processes that a sandbox with scratch directories under ``scratch_root`` started: the
    sample and whatever it started inherit HOME=<its scratch directory> in their environment, whatever their uid,
    process group or session (readable for every process as root, for this user's as anyone else)."""
    marker = f"HOME={os.path.join(str(scratch_root), 'sandbox-')}".encode()
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                environ = f.read().split(b"\0")
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != b"Z" and any(var.startswith(marker) for var in environ):
            pids.append(int(entry.name))
    return pids


def _live_sample_processes(sandbox, scratch_root, grace: float = 5.0) -> list[int]:
    """The processes of the sandbox's samples (by scratch directory, and by sample uid as root) still alive after
    waiting up to ``grace`` seconds for each to exit (a SIGKILLed process takes a moment to go)."""
    def live():
        return sorted(set(_sample_processes(scratch_root)) | {
            pid for uid in sandbox.sample_uids for pid in _proc_tasks(uid)[0]})

    deadline = time.monotonic() + grace
    for pid in live():
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:  # gone already
            continue
        try:
            select.select([pidfd], [], [], max(0.0, deadline - time.monotonic()))  # readable once it has exited
        finally:
            os.close(pidfd)
    return live()


def _misbehaving(problems, task, sentinel, port):
    """(name, completion): each would pass if its guard failed (the function is correct, the mischief is extra
    top-level code), so "not passed" shows the guard held."""
    body = _canonical_body(problems, task)
    return [
        ("good", body),
        ("loops forever", "    while True:\n        pass\n"),
        # 1 GiB (past the 256 MiB RLIMIT_AS) and then return normally: bounded, so a failed guard costs 1 GiB.
        ("allocates past the limit", body + "\nchunks = [bytearray(8 << 20) for _ in range(128)]\n"),
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
    assert outcome["allocates past the limit"] == "failed: MemoryError"  # RLIMIT_AS, not the wall clock
    assert outcome["exits before the tests"] == "failed: SystemExit: 0"
    for name in ("forks", "deletes a file outside scratch", "removes a tree outside scratch", "opens a socket"):
        assert outcome[name].startswith("failed: "), (name, outcome[name])
    assert sentinel.read_text() == "keep me"
    assert not _accepted_any(server)
    assert evaluation.pass_at_k[1] == pytest.approx(estimate_pass_at_k(len(cases), 2, 1))
    assert list(scratch_root.iterdir()) == []  # every scratch directory deleted
    assert _live_sample_processes(sandbox, scratch_root) == []
    assert elapsed < 30


def test_kernel_guards_hold_without_the_python_ones(problems, tmp_path):
    """With the Python-level guards off, what the kernel enforces alone: the process limit, the network
    namespace and (as root) the sample's own unprivileged uid; no process a sample started outlives it."""
    scratch_root = tmp_path / "scratch"
    scratch_root.mkdir()
    sandbox = Sandbox(SandboxConfig(timeout=3.0, memory_mb=256, python_guards=False, scratch_root=str(scratch_root)),
                      workers=2)
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
    assert _live_sample_processes(sandbox, scratch_root) == []  # e.g. the children "forks" made before the limit
    if "opens a socket" in outcome:
        assert "Network is unreachable" in outcome.pop("opens a socket")
    assert not outcome
    assert sentinel.read_text() == "keep me"
    assert not _accepted_any(server)


# (the limit, the config that sets it, a program that runs to its end without the limit, the failure expected)
RLIMIT_CASES = [
    ("RLIMIT_AS", {"memory_mb": 256}, "chunks = [bytearray(8 << 20) for _ in range(128)]\n", "failed: MemoryError"),
    ("RLIMIT_FSIZE", {"max_file_mb": 1}, "with open('big.bin', 'wb') as f:\n    f.write(b'x' * (2 << 20))\n",
     "failed: OSError: [Errno 27] File too large"),
    ("RLIMIT_NOFILE", {"max_open_files": 32}, "import os\nfds = [os.open(os.devnull, os.O_RDONLY) for _ in range(64)]\n",
     "failed: OSError: [Errno 24] Too many open files"),
    ("RLIMIT_CPU", {}, "import time\nwhile time.process_time() < 4:\n    pass\n",
     "failed: killed by SIGXCPU (CPU time limit)"),
]


@pytest.mark.parametrize("config, program, expected", [case[1:] for case in RLIMIT_CASES],
                         ids=[case[0] for case in RLIMIT_CASES])
def test_each_resource_limit_stops_a_sample(tmp_path, config, program, expected):
    """A program that passes unless its limit stops it fails with that limit's own error, well before the wall
    clock (10 s). RLIMIT_CPU is timeout + 1 s, which one thread never reaches before the wall clock kills it:
    here it is cut to 1 s to see the kernel enforce it."""
    scratch_root = tmp_path / "scratch"
    scratch_root.mkdir()
    sandbox = Sandbox(SandboxConfig(timeout=10.0, scratch_root=str(scratch_root), **config), workers=1)
    assert "RLIMIT_CPU 11 s" in sandbox.guards["time"]
    sandbox._cpu_seconds = lambda: 1
    result = sandbox.run(program)
    assert result.result.startswith(expected), result
    assert result.seconds < 8, result
    assert list(scratch_root.iterdir()) == []


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
