"""Run one process tree to its end or its deadline, kill all of it, and keep the tail of its output.

The harness waits on a pidfd (Linux 5.3+) while it reads stdout and stderr, keeping only their last
``output_bytes``; a sample that prints without end costs the harness reads, never memory. With bubblewrap,
``--info-fd`` names the sandbox's init (pid 1 of its pid namespace): SIGKILLing it makes the kernel kill every
process in the namespace, a daemon that left its session included, and its exit is seen only once all of them
are gone. The process group of the command itself is killed too (bubblewrap's own processes, or in the unsafe
mode the sample and what stayed in its session).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass

_REAP_SECONDS = 10.0  # how long a SIGKILLed tree may take to go before the harness moves on


@dataclass
class Finished:
    returncode: int  # bubblewrap reports a command killed by signal N as 128 + N
    timed_out: bool
    seconds: float
    stdout: bytes  # the last output_bytes of each
    stderr: bytes
    sandbox_started: bool  # bubblewrap reported the sandbox's init: the set-up got as far as the command


def _sandbox_init(info: bytes) -> int | None:
    """A pidfd of the init bubblewrap's ``--info-fd`` JSON names, once it is complete; None until then, or when
    that pid is no longer the one in the sandbox's pid namespace (it exited and the pid was reused)."""
    try:
        data = json.loads(info)
        pid, namespace = int(data["child-pid"]), int(data["pid-namespace"])
    except (ValueError, KeyError, TypeError):
        return None
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return None
    try:
        if os.stat(f"/proc/{pid}/ns/pid").st_ino == namespace:
            return pidfd
    except OSError:
        pass
    os.close(pidfd)
    return None


def _wait_readable(fd: int, seconds: float) -> bool:
    return bool(select.select([fd], [], [], seconds)[0])


def _drain(fd: int, tail: bytearray, limit: int) -> None:
    """Whatever is left in a pipe, without waiting for writers that may still hold it."""
    os.set_blocking(fd, False)
    try:
        while data := os.read(fd, 65536):
            _keep(tail, data, limit)
    except BlockingIOError:
        pass


def _keep(tail: bytearray, data: bytes, limit: int) -> None:
    tail += data
    if len(tail) > limit:
        del tail[:-limit]


def user_tasks() -> int:
    """Processes and threads of this real uid (unsafe mode: RLIMIT_NPROC counts them all)."""
    uid, tasks = os.getuid(), 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/status", "rb") as f:
                    fields = dict(line.split(b":", 1) for line in f if b":" in line)
                if int(fields[b"Uid"].split()[0]) == uid:
                    tasks += int(fields[b"Threads"])
            except (OSError, KeyError, ValueError, IndexError):
                continue
    return tasks


def run_tree(argv: Sequence[str], *, stdin, env: dict, cwd: str, pass_fds: Sequence[int], timeout: float,
             output_bytes: int, info_fd: int | None = None) -> Finished:
    """Start ``argv`` in a new session, wait at most ``timeout`` seconds, then SIGKILL what is left (the sandbox's
    init when ``info_fd``, the read end of bubblewrap's ``--info-fd``, named it; the process group) and reap."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    tails = {out_r: bytearray(), err_r: bytearray()}
    init = pidfd = None
    info = b""
    start = time.monotonic()
    try:
        try:
            proc = subprocess.Popen(argv, stdin=stdin, stdout=out_w, stderr=err_w, pass_fds=tuple(pass_fds), env=env,
                                    cwd=cwd, start_new_session=True)
        finally:
            os.close(out_w)
            os.close(err_w)
        try:
            pidfd = os.pidfd_open(proc.pid)
            poller = select.poll()
            for fd in (pidfd, out_r, err_r, *([info_fd] if info_fd is not None else [])):
                poller.register(fd, select.POLLIN)
            exited = False
            while not exited and (remaining := start + timeout - time.monotonic()) > 0:
                for fd, _ in poller.poll(remaining * 1000):
                    if fd == pidfd:
                        exited = True
                        continue
                    data = os.read(fd, 65536)
                    if not data:
                        poller.unregister(fd)
                    elif fd == info_fd:
                        info += data
                        init = init if init is not None else _sandbox_init(info)
                    else:
                        _keep(tails[fd], data, output_bytes)
            seconds = time.monotonic() - start
        finally:
            if init is not None:
                try:
                    signal.pidfd_send_signal(init, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # unreaped, so the group id is still ours to signal
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
            if init is not None:
                _wait_readable(init, _REAP_SECONDS)
        for fd, tail in tails.items():
            _drain(fd, tail, output_bytes)
        return Finished(proc.returncode, not exited, seconds, bytes(tails[out_r]), bytes(tails[err_r]),
                        init is not None or b"child-pid" in info)
    finally:
        for fd in (out_r, err_r, pidfd, init):
            if fd is not None:
                os.close(fd)
