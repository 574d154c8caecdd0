"""The first code a sandboxed sample's fresh interpreter runs.

The harness (``sandbox.py``) starts ``python -I -B -S -c <this file's source>`` in a new session, with a fresh
scratch directory as its working directory, a minimal environment and a pipe to report success on; it sends
one marshalled dict on stdin: the program to run and the guards to put up. Before any of the program's code runs,
this bootstrap, in order:

1. sets hard resource limits (address space, CPU seconds, file size, open files, processes, no core files);
2. moves into a new network namespace (no interface up, not even loopback): ``unshare(CLONE_NEWNET)`` as
   root, ``unshare(CLONE_NEWUSER | CLONE_NEWNET)`` otherwise (needs unprivileged user namespaces);
3. as root: becomes the sandbox's own unprivileged uid/gid (no supplementary groups), keeping only
   CAP_DAC_READ_SEARCH, so it can still read (the interpreter's stdlib may live under a 0700 /root) but the
   kernel refuses every write its uid may not do; then ``no_new_privs`` and a parent-death SIGKILL;
4. installs Python-level guards: no process creation (fork, exec, spawn, subprocess, os.system), no signals
   to other processes, no new session, no sockets, no ctypes, and no file removal, renaming, permission
   change or opening for write outside the scratch directory;
5. runs the program; only if it returns normally does it write the harness's one-time token to the pipe.

Nothing here imports codegeex_train: it runs in a bare interpreter. It is a best-effort guard against
generated code that misbehaves by accident (loops, runaway memory, forks, ``rm``), not a security boundary
against code written to escape: the Python-level guards can be undone from Python. What the kernel enforces
(limits, namespaces, the uid) cannot.
"""

import builtins
import io
import marshal
import os
import posix
import resource
import signal
import sys

_CLONE_NEWNET = 0x40000000
_CLONE_NEWUSER = 0x10000000
_PR_SET_PDEATHSIG = 1
_PR_SET_DUMPABLE = 4
_PR_SET_KEEPCAPS = 8
_PR_SET_NO_NEW_PRIVS = 38
_CAP_DAC_READ_SEARCH = 2
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


class SandboxSetupError(Exception):
    """A guard the harness asked for could not be put up."""


def _libc():
    import ctypes

    return ctypes, ctypes.CDLL(None, use_errno=True)


def _check(ctypes, result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise SandboxSetupError(f"{what}: {os.strerror(err)} (errno {err})")


def set_limits(limits: dict) -> None:
    def hard(res, value):
        resource.setrlimit(res, (value, value))

    if limits.get("memory_bytes"):
        hard(resource.RLIMIT_AS, limits["memory_bytes"])
    if limits.get("cpu_seconds"):
        # SIGXCPU at the soft limit, SIGKILL one second later.
        resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_seconds"], limits["cpu_seconds"] + 1))
    if limits.get("file_bytes"):
        hard(resource.RLIMIT_FSIZE, limits["file_bytes"])
    if limits.get("open_files"):
        hard(resource.RLIMIT_NOFILE, limits["open_files"])
    if limits.get("processes"):
        hard(resource.RLIMIT_NPROC, limits["processes"])
    hard(resource.RLIMIT_CORE, 0)


def isolate_network() -> None:
    unshare = getattr(os, "unshare", None)  # Python 3.12+
    flags = _CLONE_NEWNET if os.geteuid() == 0 else _CLONE_NEWUSER | _CLONE_NEWNET
    if unshare is not None:
        try:
            unshare(flags)
        except OSError as e:
            raise SandboxSetupError(f"unshare(network namespace): {e.strerror} (errno {e.errno})") from None
        return
    ctypes, libc = _libc()
    _check(ctypes, libc.unshare(flags), "unshare(network namespace)")


def drop_privileges(uid: int, gid: int) -> None:
    """Become ``uid``/``gid`` for good (real, effective and saved), keeping only CAP_DAC_READ_SEARCH."""
    ctypes, libc = _libc()
    _check(ctypes, libc.prctl(_PR_SET_KEEPCAPS, 1, 0, 0, 0), "prctl(PR_SET_KEEPCAPS)")
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]

    header = Header(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (Data * 2)()
    data[0].effective = data[0].permitted = 1 << _CAP_DAC_READ_SEARCH
    _check(ctypes, libc.capset(ctypes.byref(header), data), "capset(CAP_DAC_READ_SEARCH)")
    _check(ctypes, libc.prctl(_PR_SET_KEEPCAPS, 0, 0, 0, 0), "prctl(PR_SET_KEEPCAPS, 0)")
    # A uid change makes the process non-dumpable, which hides /proc/self/fd; the guards below read it.
    libc.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)


def final_prctls(parent: int) -> None:
    ctypes, libc = _libc()
    _check(ctypes, libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    # Set after the uid change (which clears it): if the harness dies, so does the sample.
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def install_guards(scratch: str) -> None:
    """Python-level refusals (PermissionError) of what a HumanEval completion has no business doing."""
    scratch = os.path.realpath(scratch)
    realpath, join, dirname, basename = os.path.realpath, os.path.join, os.path.dirname, os.path.basename
    getcwd, readlink, fsdecode, fspath = os.getcwd, os.readlink, os.fsdecode, os.fspath

    def resolve(path, dir_fd=None, follow=True) -> str:
        path = fsdecode(fspath(path))
        base = getcwd() if dir_fd is None else readlink(f"/proc/self/fd/{dir_fd}")
        full = join(base, path)
        if follow:
            return realpath(full)
        return join(realpath(dirname(full)), basename(full))  # the link itself, not its target

    def inside(path, dir_fd=None, follow=True) -> bool:
        if isinstance(path, int):  # an open descriptor: opening it was checked
            return True
        try:
            full = resolve(path, dir_fd, follow)
        except (OSError, TypeError, ValueError):
            return False
        return full == scratch or full.startswith(scratch + os.sep)

    def refuse(what: str):
        raise PermissionError(f"sandbox: {what} is not allowed")

    modules = (os, posix)

    def replace(name, wrapper):
        for module in modules:
            if hasattr(module, name):
                setattr(module, name, wrapper)

    def path_guard(name, nargs=1, follow=False):
        original = getattr(os, name, None)
        if original is None:
            return

        def guarded(*args, **kwargs):
            if nargs == 2:
                src = args[0] if args else kwargs.get("src")
                dst = args[1] if len(args) > 1 else kwargs.get("dst")
                checks = [(src, kwargs.get("src_dir_fd")), (dst, kwargs.get("dst_dir_fd"))]
            else:
                checks = [(args[0] if args else kwargs.get("path"), kwargs.get("dir_fd"))]
            for path, dir_fd in checks:
                if path is not None and not inside(path, dir_fd, follow):
                    refuse(f"os.{name}({path!r}) outside the scratch directory")
            return original(*args, **kwargs)

        guarded.__name__ = name
        replace(name, guarded)

    for name in ("remove", "unlink", "rmdir", "mkdir", "mkfifo", "mknod", "chown", "lchown", "lchmod"):
        path_guard(name)
    for name in ("chmod", "truncate", "utime", "chflags", "lchflags", "setxattr", "removexattr"):
        path_guard(name, follow=True)
    for name in ("rename", "replace", "link"):
        path_guard(name, nargs=2)

    original_symlink = os.symlink

    def symlink(src, dst, *args, **kwargs):
        if not inside(dst, kwargs.get("dir_fd"), follow=False):
            refuse(f"os.symlink(..., {dst!r}) outside the scratch directory")
        return original_symlink(src, dst, *args, **kwargs)

    replace("symlink", symlink)

    original_os_open = os.open

    def os_open(path, flags, *args, **kwargs):
        if flags & _WRITE_FLAGS and not inside(path, kwargs.get("dir_fd")):
            refuse(f"os.open({path!r}) for writing outside the scratch directory")
        return original_os_open(path, flags, *args, **kwargs)

    replace("open", os_open)

    original_open = io.open

    def open_(file, mode="r", *args, **kwargs):
        if isinstance(mode, str) and any(c in mode for c in "wax+") and not inside(file):
            refuse(f"open({file!r}, {mode!r}) outside the scratch directory")
        return original_open(file, mode, *args, **kwargs)

    builtins.open = io.open = open_

    # shutil.rmtree and friends need no patch of their own: they remove through the os functions above
    # (with dir_fd, resolved through /proc/self/fd).

    def no(what):
        def refused(*args, **kwargs):
            refuse(what)

        return refused

    for name in ("fork", "forkpty", "system", "popen", "posix_spawn", "posix_spawnp", "spawnv", "spawnve",
                 "spawnvp", "spawnvpe", "spawnl", "spawnle", "spawnlp", "spawnlpe", "execv", "execve",
                 "execl", "execle", "execlp", "execlpe", "execvp", "execvpe", "setsid", "setpgid", "setpgrp",
                 "killpg", "pidfd_open"):
        replace(name, no(f"os.{name}"))
    original_kill = os.kill
    own_pid = os.getpid()

    def kill(pid, sig):
        if pid != own_pid:
            refuse("os.kill of another process")
        return original_kill(pid, sig)

    replace("kill", kill)

    # subprocess (imported or not) starts every child through _posixsubprocess.fork_exec.
    import _posixsubprocess

    _posixsubprocess.fork_exec = no("subprocess (_posixsubprocess.fork_exec)")
    # The socket module subclasses _socket.socket: a subclass that refuses to be built keeps `import socket`
    # working and every socket it would make refused.
    import _socket

    original_socket = _socket.socket

    class NoSocket(original_socket):
        __slots__ = ()

        def __init__(self, *args, **kwargs):
            refuse("sockets (no network in the sandbox)")

    _socket.socket = _socket.SocketType = NoSocket
    for name in ("socketpair", "fromfd"):
        if hasattr(_socket, name):
            setattr(_socket, name, no(f"_socket.{name} (no network in the sandbox)"))
    if "socket" in sys.modules:  # imported during start-up: patch the module's names too
        module = sys.modules["socket"]
        module.socket.__init__ = NoSocket.__init__
        for name in ("socketpair", "fromfd"):
            setattr(module, name, no(f"socket.{name} (no network in the sandbox)"))
    for name in ("ctypes", "_ctypes"):
        sys.modules[name] = None  # `import ctypes` now raises ImportError


def run(program: str, token: str, result_fd: int) -> None:
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(compile(program, "<sample>", "exec"), namespace)
    except BaseException as e:  # SystemExit and KeyboardInterrupt included: the tests did not finish
        try:
            import traceback

            sys.stdout.flush()
            traceback.print_exc()
            sys.stderr.flush()
        except BaseException:
            pass
        try:
            os.write(2, f"\n{type(e).__name__}: {e}\n".encode(errors="replace")[-2000:])
        except BaseException:
            os.write(2, f"\n{type(e).__name__}\n".encode())
        os._exit(1)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        pass
    try:
        os.write(result_fd, token.encode())
    except OSError:
        os._exit(1)
    os._exit(0)


def main() -> None:
    spec = marshal.loads(sys.stdin.buffer.read())  # marshal: no import (json would import re, enum, ...)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    try:
        set_limits(spec["limits"])
        if spec["network_namespace"]:
            isolate_network()
        if spec["uid"] is not None:
            drop_privileges(spec["uid"], spec["gid"])
        final_prctls(spec["parent"])
        if spec.get("probe"):  # the harness asks what holds: report and stop
            for module in spec["probe_imports"]:
                __import__(module)
            os.write(spec["result_fd"], f"uid {os.getuid()} euid {os.geteuid()}".encode())
            os._exit(0)
        if spec["python_guards"]:
            install_guards(spec["scratch"])
    except BaseException as e:
        os.write(2, f"\nsandbox setup failed: {type(e).__name__}: {e}\n".encode(errors="replace"))
        os._exit(3)
    token, result_fd, program = spec["token"], spec["result_fd"], spec["program"]
    del spec
    run(program, token, result_fd)


if __name__ == "__main__":
    main()
