"""The first code a sample's fresh interpreter runs, inside the sandbox (or, unsafe, without one).

The harness (``sandbox.py``) starts ``python -I -B -S -c <this file's source>`` with the scratch directory as
its working directory and a pipe to report success on, and gives it one marshalled dict on stdin. Before any of
the sample's code runs, this bootstrap, in order:

1. sets hard resource limits (address space, CPU seconds, file size, open files, processes, no core files):
   bubblewrap has no option for them, and set here they hold for everything the sample starts;
2. writes the job's files into the scratch directory;
3. for a command (a compiled language's build and run): becomes it (``execvp``), and its exit status decides;
4. for a Python program: installs the Python-level guards when asked (defence in depth only: they can be undone
   from Python; the kernel's isolation is what holds), runs the program, and only if it returns normally
   writes the harness's one-time token to the pipe (``sys.exit(0)`` before the tests finish is a failure).

Nothing here imports codegeex_train: it runs in a bare interpreter.
"""

import builtins
import io
import marshal
import os
import posix
import resource
import sys

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
SETUP_FAILED = 3  # the exit status when the limits or the files could not be put in place
EXEC_FAILED = 127  # the command could not be started (as a shell says)


def set_limits(limits: dict) -> None:
    def hard(res, value):
        resource.setrlimit(res, (value, value))

    hard(resource.RLIMIT_AS, limits["memory_bytes"])
    # SIGXCPU at the soft limit, SIGKILL one second later.
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_seconds"], limits["cpu_seconds"] + 1))
    hard(resource.RLIMIT_FSIZE, limits["file_bytes"])
    hard(resource.RLIMIT_NOFILE, limits["open_files"])
    if limits.get("processes"):
        hard(resource.RLIMIT_NPROC, limits["processes"])
    hard(resource.RLIMIT_CORE, 0)


def write_files(files: dict) -> None:
    """``files`` (relative name -> str or bytes) into the working directory, never through a link."""
    for name, data in files.items():
        parts = name.split("/")
        if name.startswith("/") or ".." in parts or "" in parts:
            raise ValueError(f"file name {name!r}: must be relative, without '..'")
        if len(parts) > 1:
            os.makedirs("/".join(parts[:-1]), exist_ok=True)
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)


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
        write_files(spec.get("files") or {})
        if spec.get("python_guards") and not spec.get("argv"):
            install_guards(os.getcwd())
    except BaseException as e:
        os.write(2, f"\nsandbox setup failed: {type(e).__name__}: {e}\n".encode(errors="replace"))
        os._exit(SETUP_FAILED)
    if spec.get("argv"):
        argv = spec["argv"]
        try:
            os.execvp(argv[0], argv)
        except OSError as e:
            os.write(2, f"\ncannot run {argv[0]}: {e.strerror}\n".encode(errors="replace"))
            os._exit(EXEC_FAILED)
    token, result_fd, program = spec["token"], spec["result_fd"], spec["program"]
    del spec
    run(program, token, result_fd)


if __name__ == "__main__":
    main()
