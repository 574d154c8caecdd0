"""The HumanEval harness scores canonical solutions 1 and wrong ones 0; a sample that loops, allocates past its
memory limit, forks, deletes files outside its scratch directory, opens a socket or exits early is stopped and
counted as failed while the harness goes on; each resource limit (address space, file size, open files, CPU
seconds, processes) stops a sample with its own failure; commands (``CommandJob``: a C++ build and run) pass on
exit status 0 with their files, environment and read-only paths. ``test_hostile_samples.py`` tries to escape."""

import shutil
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
from codegeex_train.evaluation.sandbox import CommandJob


@pytest.fixture(scope="module")
def problems():
    return read_problems()


@pytest.fixture(scope="module")
def scoring_sandbox():
    # A generous time limit: these samples are all quick, and a loaded CI machine must not fail them.
    return Sandbox(SandboxConfig(timeout=20.0), workers=2)


@pytest.mark.slow
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
    server = _listener()
    cases = _misbehaving(problems, task, sentinel, server.getsockname()[1])
    sandbox = Sandbox(SandboxConfig(timeout=2.0, memory_mb=256), workers=2)
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
    assert elapsed < 30


def test_kernel_guards_hold_without_the_python_ones(problems, tmp_path):
    """With the Python-level guards off: the process limit, the private filesystem and the network namespace
    (the full set of attacks is in test_hostile_samples.py)."""
    sandbox = Sandbox(SandboxConfig(timeout=3.0, memory_mb=256, python_guards=False), workers=2)
    task = "HumanEval/0"
    body = _canonical_body(problems, task)
    sentinel = tmp_path / "outside" / "sentinel.txt"
    sentinel.parent.mkdir()
    sentinel.write_text("keep me")
    server = _listener()
    cases = [("good", body), ("forks", _misbehaving(problems, task, sentinel, 0)[3][1]),
             ("deletes a file outside scratch", body + f"\nimport os\nos.remove({str(sentinel)!r})\n"),
             ("opens a socket", body + "\nimport socket\nsocket.create_connection(('127.0.0.1', "
                                       f"{server.getsockname()[1]}), timeout=2)\n"),
             ("good again", body)]
    evaluation = evaluate_samples({task: problems[task]}, [{"task_id": task, "completion": c} for _, c in cases],
                                  sandbox=sandbox)
    outcome = {name: r["result"] for (name, _), r in zip(cases, evaluation.results)}
    assert outcome.pop("good") == "passed" and outcome.pop("good again") == "passed", outcome
    assert "Resource temporarily unavailable" in outcome["forks"]  # RLIMIT_NPROC
    assert "No such file or directory" in outcome["deletes a file outside scratch"]  # not in its view at all
    assert "Connection refused" in outcome["opens a socket"]  # its own loopback, nothing listening
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
    ("RLIMIT_NPROC", {"max_processes": 4}, ("import threading, time\nthreads = [threading.Thread(target=time.sleep, "
                                            "args=(1,)) for _ in range(8)]\nfor t in threads:\n    t.start()\n"),
     "failed: RuntimeError: can't start new thread"),
]


@pytest.mark.parametrize("config, program, expected", [case[1:] for case in RLIMIT_CASES],
                         ids=[case[0] for case in RLIMIT_CASES])
def test_each_resource_limit_stops_a_sample(config, program, expected):
    """A program that passes unless its limit stops it fails with that limit's own error, well before the wall
    clock (10 s). RLIMIT_CPU is timeout + 1 s, which one thread never reaches before the wall clock kills it:
    here it is cut to 1 s to see the kernel enforce it."""
    sandbox = Sandbox(SandboxConfig(timeout=10.0, python_guards=False, **config), workers=1)
    assert "RLIMIT_CPU 11 s" in sandbox.guards["time"]
    sandbox._cpu_seconds = lambda timeout: 1
    result = sandbox.run(program)
    assert result.result.startswith(expected), result
    assert result.seconds < 8, result


def test_guards_are_reported(scoring_sandbox):
    guards = scoring_sandbox.guards
    assert set(guards) == {"isolation", "time", "memory", "output", "files", "processes", "network", "python"}
    assert guards["isolation"].startswith("bubblewrap ") and not scoring_sandbox.unsafe
    assert "RLIMIT_AS 2048 MiB" in guards["memory"]
    assert "own user namespace" in guards["processes"] and "own loopback only" in guards["network"]


def test_a_pass_needs_the_program_to_finish():
    sandbox = Sandbox(SandboxConfig(timeout=5.0), workers=1)
    assert sandbox.run("x = 1\n").result == "passed"
    assert sandbox.run("import os\nos._exit(0)\n").result == "failed: exited before the tests finished"
    assert sandbox.run("raise ValueError('nope')\n").result == "failed: ValueError: nope"
    assert sandbox.run("assert 1 == 2\n").result == "failed: AssertionError"
    assert sandbox.run("def f(:\n").result.startswith("failed: SyntaxError")
    assert sandbox.run("import os\nassert 'HOME' in os.environ and not os.listdir('.')\n"
                       "assert os.environ.keys() <= {'PATH', 'HOME', 'TMPDIR', 'LANG', 'LC_CTYPE', 'PWD'}\n").passed
    assert sandbox.run("open('x.txt', 'w').write('inside scratch is fine')\nimport os\nos.remove('x.txt')\n").passed
    assert sandbox.run("import os, shutil, tempfile\nos.makedirs('d/e')\nopen('d/e/f', 'w').close()\n"
                       "shutil.rmtree('d')\ntempfile.NamedTemporaryFile().close()\nimport socket\n").passed


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


CPP_OK = "#include <cstdio>\nint main() { std::printf(\"%d\\n\", 6 * 7); return 0; }\n"
CPP_FAILS = "#include <cassert>\nint main() { assert(6 * 7 == 41); return 0; }\n"
BUILD_AND_RUN = ("/bin/sh", "-c", "g++ -O0 main.cpp -o main && ./main")


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed (make humaneval-x-deps installs it)")
def test_a_cpp_job_builds_and_runs():
    sandbox = Sandbox(SandboxConfig(timeout=5.0), workers=2)
    env = {"PATH": "/usr/bin:/bin"}
    jobs = [CommandJob(BUILD_AND_RUN, {"main.cpp": CPP_OK}, env, timeout=60, max_processes=32),
            CommandJob(BUILD_AND_RUN, {"main.cpp": CPP_FAILS}, env, timeout=60, max_processes=32),
            CommandJob(BUILD_AND_RUN, {"main.cpp": "int main( {"}, env, timeout=60, max_processes=32)]
    seen = []
    ok, failed, broken = sandbox.run_many_commands(jobs, progress=lambda i, r: seen.append(i))
    assert sorted(seen) == [0, 1, 2]
    assert ok.passed and ok.output == "42\n", ok
    assert failed.result.startswith("failed: killed by SIGABRT: ") and "Assertion" in failed.result, failed
    assert broken.result.startswith("failed: exit status 1: ") and "error" in broken.result, broken


def test_command_jobs_get_their_files_environment_and_read_only_paths(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "data.txt").write_text("from the host")
    for path in (tmp_path, shared, shared / "data.txt"):  # as root, samples run as nobody: readable by others
        path.chmod(path.stat().st_mode | 0o005)
    script = ('set -e; test "$(cat src/a.txt)" = hello; test "$HOME" = "$PWD"; test "$GREETING" = hi; '
              f'test -z "${{USER:-}}"; cat {shared}/data.txt; ! touch {shared}/new 2>/dev/null; echo done')
    job = CommandJob(("/bin/sh", "-c", script), {"src/a.txt": "hello"}, {"PATH": "/usr/bin:/bin", "GREETING": "hi"},
                     ro_paths=(str(shared),))
    sandbox = Sandbox(SandboxConfig(timeout=10.0), workers=1)
    result = sandbox.run_command(job)
    assert result.passed, result
    assert result.output == "from the hostdone\n"
    assert not (shared / "new").exists()
    assert sandbox.run_command(CommandJob(("/bin/sh", "-c", "exit 3"), {})).result == "failed: exit status 3"
    assert sandbox.run_command(CommandJob(("no-such-tool",), {})).result == (
        "failed: exit status 127: cannot run no-such-tool: No such file or directory")
    slow = sandbox.run_command(CommandJob(("/bin/sh", "-c", "sleep 30"), {}, timeout=0.5))
    assert slow.result == "timed out" and slow.seconds < 5


def test_output_is_bounded():
    sandbox = Sandbox(SandboxConfig(timeout=20.0, output_kb=4), workers=1)
    result = sandbox.run_command(CommandJob(("/bin/sh", "-c", "yes 0123456789 | head -c 20000000; echo end >&2"),
                                            {}, {"PATH": "/usr/bin:/bin"}))
    assert result.passed and len(result.output) <= 8 << 10, result  # 4 KiB of stdout's end, then stderr's
    assert result.output.endswith("end\n") and "0123456789\n" in result.output, result


@pytest.mark.parametrize("bad", [{"argv": ()}, {"files": {"../x": ""}}, {"files": {"/etc/x": ""}},
                                 {"files": {"a//b": ""}}, {"timeout": 0}])
def test_bad_command_jobs(bad):
    with pytest.raises(ValueError):
        CommandJob(**{"argv": ("true",), "files": {}, **bad})
    with pytest.raises(ValueError):
        Sandbox(SandboxConfig(timeout=5.0), workers=1).run_command(CommandJob(("true",), {}, ro_paths=("relative",)))
