"""Hostile samples with the Python-level guards OFF: only the kernel's isolation (bubblewrap) stands between them
and this machine. Each case is a real attempt whose success the test would see (a secret in the output, a file
or process on the host, a byte at a listener, a dead canary); every one is stopped, leaves nothing behind, and
the harness goes on scoring good and wrong samples right. Then the set-up failures (one error line that says
what to install or allow) and ``--unsafe-no-sandbox`` (a warning in every record)."""

import json
import os
import re
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from codegeex_train.evaluation import (
    Sandbox,
    SandboxConfig,
    SandboxError,
    evaluate_samples,
    read_problems,
    write_jsonl,
)
from codegeex_train.evaluation.sandbox import UNSAFE
from tests.harness import run_process_group

ROOT = Path(__file__).resolve().parents[2]
TOKEN = secrets.token_hex(6)
SECRET = f"codegeex-secret-{TOKEN}"
MARKERS = {name: f"{96 + i}.{int(TOKEN, 16) % 10**9:09d}"
           for i, name in enumerate(("daemon", "daemon then hang", "bomb", "sigterm"))}
TIMEOUT = 2.0


def _attempt(body: str) -> str:
    """A program that passes only if ``body`` leaves ``won`` non-empty (the attack worked); prints what it got."""
    return f"won = []\n{body}\nprint('WON', won)\nassert won, 'nothing got through'\n"


def _processes_with(marker: str) -> list[int]:
    """Live processes on the host whose command line holds ``marker`` (the hostile programs exec `sleep
    <marker>`)."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                    cmdline = f.read()
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    state = f.read().rsplit(b")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if marker.encode() in cmdline and state != b"Z":
                found.append(int(entry.name))
    return found


def _new_files_of_nobody(since: float) -> list[str]:
    """Entries of the host's /tmp and /dev/shm owned by nobody (as root, samples run as the host's nobody) and
    changed since ``since``: what a sample would leave there if it could."""
    found = []
    for directory in ("/tmp", "/dev/shm"):
        for entry in os.scandir(directory):
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if info.st_uid == 65534 and info.st_mtime >= since:
                found.append(entry.path)
    return found


class Host:
    """What the hostile programs go for: secrets, writable places, listeners, a canary process."""

    def __init__(self, tmp: Path) -> None:
        home = tmp / "home"
        home.mkdir(mode=0o700)
        (home / ".netrc").write_text(f"machine example.com password {SECRET}\n")
        (home / ".netrc").chmod(0o600)
        (tmp / "root_only.txt").write_text(SECRET)
        (tmp / "root_only.txt").chmod(0o600)
        self.readable = [str(home / ".netrc"), str(tmp / "root_only.txt"), "/etc/shadow"]
        world = tmp / "world"
        world.mkdir()
        world.chmod(0o1777)
        self.writable = [str(world / f"w-{TOKEN}"), f"/dev/shm/hostile-{TOKEN}", f"/tmp/hostile-{TOKEN}",
                         str(ROOT / f"hostile-{TOKEN}"), os.path.join(os.path.expanduser("~"), f"hostile-{TOKEN}")]
        self.through_link = str(world / f"via-link-{TOKEN}")
        self.tcp = socket.create_server(("127.0.0.1", 0))
        self.abstract = socket.socket(socket.AF_UNIX)
        self.abstract.bind(f"\0codegeex-hostile-{TOKEN}")
        self.abstract.listen()
        sockets = tmp / "sockets"
        sockets.mkdir()
        sockets.chmod(0o777)
        self.unix_path = str(sockets / "service.sock")
        self.unix = socket.socket(socket.AF_UNIX)
        self.unix.bind(self.unix_path)
        os.chmod(self.unix_path, 0o777)
        self.unix.listen()
        self.listeners = [self.tcp, self.abstract, self.unix]
        for listener in self.listeners:
            listener.setblocking(False)
        # A process of the harness's user with a secret in its environment, as the harness's may hold credentials
        # (the harness's own /proc environ is its start-up one, which the test cannot add to).
        self.canary = subprocess.Popen(["sleep", "120"], env={"PATH": os.environ["PATH"], "HOSTILE_SECRET": SECRET})

    def received(self) -> list[str]:
        got = []
        for listener in self.listeners:
            try:
                connection, _ = listener.accept()
                got.append(repr(listener))
                connection.close()
            except BlockingIOError:
                pass
        return got

    def close(self) -> None:
        for listener in self.listeners:
            listener.close()
        self.canary.kill()
        self.canary.wait()


def _daemon(marker: str) -> str:
    """Double fork and setsid: a `sleep <marker>` outside the sample's session and process group."""
    return ("import os\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            f"        os.execv('/usr/bin/sleep', ['sleep', {marker!r}])\n    os._exit(0)\nos.wait()\n")


def hostile_programs(host: Host) -> dict[str, str]:
    write_all = "".join(f"try:\n    open({p!r}, 'w').write('x')\nexcept OSError as e:\n    print(e)\n"
                        for p in host.writable)
    sleep = "/usr/bin/sleep"
    return {
        "reads secret files": _attempt(
            f"for p in {host.readable!r}:\n    try:\n        won.append(open(p).read())\n"
            "    except OSError as e:\n        print(p, e)\n"),
        "reads the parent's environment": _attempt(
            f"import os\nfor pid in {{os.getppid(), 1, {os.getpid()}, {host.canary.pid}, *os.listdir('/proc')}}:\n"
            "    try:\n"
            f"        data = open(f'/proc/{{pid}}/environ', 'rb').read()\n    except (OSError, ValueError):\n"
            f"        continue\n    if {SECRET.encode()!r} in data:\n        won.append(data)\n"),
        "writes outside scratch": write_all,
        "writes through a symlink": (f"import os\nos.symlink({host.through_link!r}, 'link')\n"
                                     "open('link', 'w').write('x')\n"),
        "leaves a daemon": _daemon(MARKERS["daemon"]),
        "leaves a daemon and hangs": _daemon(MARKERS["daemon then hang"]) + "while True:\n    pass\n",
        # SIGKILL to this harness, a canary process of the test's, the parent, pid 1 and everyone it may signal:
        # the test sees the canary and itself alive (inside, pid 1 is the sandbox's own init).
        "signals the harness and pid 1": (
            f"import os, signal\nfor pid in ({os.getpid()}, {host.canary.pid}, os.getppid(), 1, -1):\n    try:\n"
            "        os.kill(pid, signal.SIGKILL)\n    except OSError as e:\n        print(pid, e)\n"),
        "connects to the host's listeners": _attempt(
            "import socket\n"
            f"for family, address in ((socket.AF_INET, ('127.0.0.1', {host.tcp.getsockname()[1]})),\n"
            f"                        (socket.AF_UNIX, '\\0codegeex-hostile-{TOKEN}'),\n"
            f"                        (socket.AF_UNIX, {host.unix_path!r})):\n"
            "    s = socket.socket(family)\n    try:\n        s.connect(address)\n        s.sendall(b'hello')\n"
            "        won.append(address)\n    except OSError as e:\n        print(address, e)\n"),
        "creates a user namespace": _attempt(
            "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "if libc.unshare(0x10000000) == 0:\n    won.append('unshare')\nprint(ctypes.get_errno())\n"),
        "fills memory": "chunks = [bytearray(64 << 20) for _ in range(64)]\n",  # 4 GiB past RLIMIT_AS
        "fills its disk": "with open('big', 'wb') as f:\n    for _ in range(1024):\n        f.write(b'x' * (1 << 20))\n",
        "fills /dev/shm": ("with open('/dev/shm/big', 'wb') as f:\n    for _ in range(1024):\n"
                           "        f.write(b'x' * (1 << 20))\n"),
        # Every process forks until RLIMIT_NPROC says no, then turns into a `sleep <marker>`.
        "fork bomb": (f"import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
                      f"        os.execv({sleep!r}, ['sleep', {MARKERS['bomb']!r}])\n"),
        "ignores SIGTERM": (f"import os, signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                            f"os.execv({sleep!r}, ['sleep', {MARKERS['sigterm']!r}])\n"),
    }


@pytest.fixture(scope="module")
def attack(tmp_path_factory):
    """Every hostile program run once (in parallel, guards off), then good and wrong samples; what the host saw."""
    tmp = tmp_path_factory.mktemp("host")
    host = Host(tmp)
    try:
        sandbox = Sandbox(SandboxConfig(timeout=TIMEOUT, memory_mb=256, scratch_mb=8, tmp_mb=8, max_processes=16,
                                        python_guards=False), workers=2)
        programs = hostile_programs(host)
        start = time.time() - 1  # (file times have coarse ticks)
        results = dict(zip(programs, sandbox.run_many(list(programs.values()))))
        problems = read_problems()
        task = "HumanEval/0"
        after = evaluate_samples({task: problems[task]}, [
            {"task_id": task, "completion": problems[task]["canonical_solution"]},
            {"task_id": task, "completion": "    return None\n"}], sandbox=sandbox)
        leftovers = {name: _processes_with(marker) for name, marker in MARKERS.items()}
        yield {"host": host, "results": results, "after": after, "leftovers": leftovers,
               "received": host.received(), "canary_alive": host.canary.poll() is None,
               "written": [p for p in [*host.writable, host.through_link] if os.path.lexists(p)],
               "left in /tmp or /dev/shm": _new_files_of_nobody(start) if os.geteuid() == 0 else []}
    finally:
        for path in [*host.writable, host.through_link]:
            if os.path.lexists(path):
                os.remove(path)
        host.close()


def _outcome(attack, name):
    result = attack["results"][name]
    assert SECRET not in result.output and SECRET not in result.result, (name, result)
    return result


@pytest.mark.parametrize("name", ["reads secret files", "reads the parent's environment",
                                  "connects to the host's listeners", "creates a user namespace", "fills memory",
                                  "fills its disk", "fills /dev/shm"])
def test_each_attempt_fails(attack, name):
    result = _outcome(attack, name)
    assert result.result.startswith("failed: "), (name, result)


def test_failures_name_the_kernel_refusal(attack):
    results = attack["results"]
    assert "No such file or directory" in results["reads secret files"].output  # not there at all
    assert results["fills memory"].result == "failed: MemoryError"
    assert "No space left on device" in results["fills its disk"].result
    assert "No space left on device" in results["fills /dev/shm"].result
    assert "Connection refused" in results["connects to the host's listeners"].output


def test_nothing_reaches_the_host(attack):
    for name in attack["results"]:
        _outcome(attack, name)
    assert attack["written"] == []  # world-writable dir, /dev/shm, /tmp, the project, HOME, through a link
    assert attack["left in /tmp or /dev/shm"] == []
    assert attack["received"] == []  # TCP, abstract and filesystem UNIX sockets
    assert attack["canary_alive"]  # and this test process, which it also tried to kill, is still here


def test_nothing_outlives_its_sample(attack):
    results = attack["results"]
    assert results["leaves a daemon"].result == "passed"  # a program that ends normally; its daemon went with it
    assert results["leaves a daemon and hangs"].result == "timed out"  # killed at the wall clock, daemon too
    assert results["fork bomb"].result in ("timed out", "failed: killed by SIGKILL"), results["fork bomb"]
    assert results["ignores SIGTERM"].result == "timed out"
    assert attack["leftovers"] == {name: [] for name in MARKERS}


def test_the_harness_goes_on_and_scores_right(attack):
    after = attack["after"]
    assert after.results[0]["result"] == "passed"
    assert after.results[1]["result"].startswith("failed: ")
    assert after.pass_at_k[1] == 0.5 and after.sandbox is None
    assert all(r.seconds <= TIMEOUT + 1 for r in attack["results"].values())


# -- set-up failures and the unsafe mode -------------------------------------------------------------------------

def test_a_missing_bwrap_is_one_clear_error(tmp_path, monkeypatch):
    with pytest.raises(SandboxError) as missing:
        Sandbox(SandboxConfig(bwrap=str(tmp_path / "bwrap")))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SandboxError) as not_on_path:
        Sandbox()
    for error in (missing, not_on_path):
        message = str(error.value)
        assert "\n" not in message
        assert "apt-get install bubblewrap" in message and "--unsafe-no-sandbox" in message, message


REFUSED = "No permissions to creating new namespace, likely because the kernel does not allow non-privileged user"


@pytest.mark.parametrize("version, complaint, fragments", [
    ("bubblewrap 0.8.0", f"bwrap: {REFUSED} namespaces.", [REFUSED, "kernel.unprivileged_userns_clone=1"]),
    ("bubblewrap 0.6.1", "", ["is bubblewrap 0.6.1", "0.8.0 or newer", "apt-get install bubblewrap"]),
], ids=["namespaces refused", "too old"])
def test_a_bwrap_that_cannot_sandbox_is_one_clear_error(tmp_path, version, complaint, fragments):
    """A bwrap that fails as one does where the kernel refuses unprivileged user namespaces, and one too old for
    the options the sandbox needs."""
    fake = tmp_path / "bwrap"
    fake.write_text(f"#!/bin/sh\nif [ \"$1\" = --version ]; then echo '{version}'; exit 0; fi\n"
                    f"echo '{complaint}' >&2\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(SandboxError) as error:
        Sandbox(SandboxConfig(bwrap=str(fake)), workers=1)
    message = str(error.value)
    assert "\n" not in message
    for fragment in [*fragments, "--unsafe-no-sandbox"]:
        assert fragment in message, message


def test_unsafe_mode_marks_every_record(tmp_path):
    problems = read_problems()
    task = "HumanEval/0"
    sandbox = Sandbox(SandboxConfig(unsafe_no_sandbox=True, timeout=20.0), workers=1)
    assert sandbox.unsafe and sandbox.isolation == UNSAFE == "none (--unsafe-no-sandbox)"
    evaluation = evaluate_samples({task: problems[task]}, [
        {"task_id": task, "completion": problems[task]["canonical_solution"]}], sandbox=sandbox)
    assert evaluation.results[0]["passed"] and evaluation.results[0]["sandbox"] == UNSAFE
    assert evaluation.metrics()["sandbox"] == UNSAFE and UNSAFE in evaluation.summary()


TOOL = [sys.executable, str(ROOT / "tools" / "evaluate_humaneval.py")]


def test_the_tool_without_bwrap_and_with_unsafe_no_sandbox(tmp_path):
    problems = read_problems()
    samples = tmp_path / "samples.jsonl"
    write_jsonl(samples, [{"task_id": "HumanEval/0", "completion": problems["HumanEval/0"]["canonical_solution"]}])
    env = {**os.environ, "PATH": str(tmp_path)}  # no bwrap on it
    args = ["--samples", str(samples), "--tasks", "1", "--workers", "1", "--timeout", "20", "--k", "1"]
    refused = run_process_group(TOOL + args, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert refused.returncode != 0 and len(lines) == 1, refused.stderr
    assert re.match(r"^evaluate_humaneval\.py: error: bubblewrap \(bwrap\) not found: install bubblewrap", lines[0])
    unsafe = run_process_group(TOOL + args + ["--unsafe-no-sandbox", "--output", str(tmp_path / "results.jsonl"),
                                              "--run-dir", str(tmp_path / "run")],
                               capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert unsafe.returncode == 0, unsafe.stderr
    assert "warning: --unsafe-no-sandbox" in unsafe.stderr and "pass@1: 1.0000" in unsafe.stdout
    [result] = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    [record] = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert result["sandbox"] == record["sandbox"] == UNSAFE
