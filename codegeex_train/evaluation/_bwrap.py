"""The bubblewrap command line that isolates one sample (``sandbox.py`` says what it enforces).

As root the sandbox is built in two stages. Root's own uid is exempt from RLIMIT_NPROC (the kernel never limits
uid 0's processes), so the sample must map to another host uid: ``nobody``. But nobody may not be able to reach
the interpreter (pyenv under a 0700 /root), and bubblewrap resolves every path it binds as the user it runs as.
So a first bwrap, as root and with a mount namespace only, puts together a read-only view that holds just the
paths to bind (their parent directories made 0755), and there ``setpriv`` becomes nobody and runs the real
sandbox. Any other user runs the real sandbox directly: its user namespace maps the sample to that user.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence

SANDBOX_DIR = "/sandbox"  # the sample's cwd and HOME: a private, size-limited tmpfs
NOBODY = 65534  # the sample's uid and gid inside; as root also the host uid it maps to
_ROOT_ENTRIES = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")  # links into /usr on merged-/usr systems
_ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives")  # what dynamic linking and Debian's
#                                                                        /usr/bin/<tool> -> /etc/alternatives need
USERNS_HINT = ("allow unprivileged user namespaces (sysctl -w kernel.unprivileged_userns_clone=1 on Debian's "
               "older kernels, user.max_user_namespaces > 0; on Ubuntu 23.10+ "
               "kernel.apparmor_restrict_unprivileged_userns=0 or an AppArmor profile for bwrap; in a container, "
               "one whose seccomp/AppArmor profile lets it create namespaces and mount /proc)")
INSTALL_HINT = "install bubblewrap (apt-get install bubblewrap; dnf install bubblewrap)"
MIN_VERSION = (0, 8, 0)  # --size (tmpfs limits) and --disable-userns: Debian 12, Ubuntu 24.04


class SetupError(RuntimeError):
    """bubblewrap (or setpriv, as root) is missing: the message says what to install."""


def _system_view() -> tuple[list[str], list[str]]:
    """(bwrap arguments, paths bound): read-only /usr, the merged-/usr links (or directories) at /, and the /etc
    files the toolchains need."""
    args, paths = ["--ro-bind", "/usr", "/usr"], ["/usr"]
    for name in _ROOT_ENTRIES:
        path = "/" + name
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
            paths.append(path)
    for name in _ETC:
        path = "/etc/" + name
        if os.path.lexists(path):
            args += ["--ro-bind", path, path]
            paths.append(path)
    return args, paths


def extra_binds(paths: Sequence[str]) -> list[str]:
    """Absolute, existing paths not already inside /usr, in order, without repeats (each bound at its place)."""
    out: list[str] = []
    for path in paths:
        if not os.path.isabs(path):
            raise ValueError(f"read-only path {path!r}: must be absolute")
        path = os.path.normpath(path)
        if not os.path.exists(path):
            raise ValueError(f"read-only path {path}: does not exist")
        real = os.path.realpath(path)
        if path not in out and not (real == "/usr" or real.startswith("/usr/")):
            out.append(path)
    return out


def _parents(paths: Sequence[str]) -> list[str]:
    """Every proper ancestor directory of ``paths`` below /, outermost first."""
    seen: list[str] = []
    for path in paths:
        parts = path.strip("/").split("/")[:-1]
        for i in range(1, len(parts) + 1):
            parent = "/" + "/".join(parts[:i])
            if parent not in seen:
                seen.append(parent)
    return seen


class Bubblewrap:
    """Finds bwrap (and setpriv as root) once and writes the command line for each sample."""

    def __init__(self, bwrap: str = "bwrap") -> None:
        found = shutil.which(bwrap)
        if found is None:
            raise SetupError(f"bubblewrap ({bwrap}) not found: {INSTALL_HINT}")
        self.bwrap = os.path.realpath(found)
        self.as_root = os.geteuid() == 0
        self.setpriv = None
        if self.as_root:
            setpriv = shutil.which("setpriv")
            if setpriv is None:
                raise SetupError("setpriv not found (as root the sandbox runs samples as nobody through it): "
                                 "install util-linux (apt-get install util-linux)")
            self.setpriv = os.path.realpath(setpriv)
        try:
            out = subprocess.run([self.bwrap, "--version"], capture_output=True, text=True, timeout=30, env={},
                                 check=False)
        except (OSError, subprocess.SubprocessError) as e:
            raise SetupError(f"{self.bwrap} does not run: {e}: {INSTALL_HINT}") from None
        self.version = out.stdout.strip()
        found_version = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", self.version)
        number = tuple(int(x or 0) for x in found_version.groups()) if found_version else (0, 0, 0)
        if number < MIN_VERSION:
            raise SetupError(f"{self.bwrap} is {self.version or 'of an unknown version'}: the sandbox needs "
                             f"bubblewrap {'.'.join(map(str, MIN_VERSION))} or newer (--size, --disable-userns; "
                             f"Debian 12, Ubuntu 24.04 have it): {INSTALL_HINT}")
        self._view, self._view_paths = _system_view()

    def argv(self, command: Sequence[str], *, ro_paths: Sequence[str], env: Mapping[str, str], scratch_mb: int,
             tmp_mb: int, info_fd: int) -> list[str]:
        """The full command line: ``command`` in the sandbox, with ``ro_paths`` (absolute, existing, as from
        ``extra_binds``) bound read-only at their place and exactly ``env`` (plus HOME and TMPDIR)."""
        view, view_paths = self._view, self._view_paths
        sandbox = ["--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
                   "--cap-drop", "ALL", "--uid", str(NOBODY), "--gid", str(NOBODY), "--hostname", "sandbox",
                   *view, "--proc", "/proc", "--dev", "/dev",
                   "--size", str(tmp_mb << 20), "--tmpfs", "/tmp",
                   "--size", str(tmp_mb << 20), "--tmpfs", "/dev/shm",
                   "--size", str(scratch_mb << 20), "--tmpfs", SANDBOX_DIR]
        for path in ro_paths:
            sandbox += ["--ro-bind", path, path]
        # Without these the root and /dev would be writable tmpfs without a size limit.
        sandbox += ["--remount-ro", "/", "--remount-ro", "/dev", "--chdir", SANDBOX_DIR, "--clearenv"]
        for name, value in {**env, "HOME": SANDBOX_DIR, "TMPDIR": "/tmp"}.items():
            sandbox += ["--setenv", name, value]
        sandbox += ["--info-fd", str(info_fd), "--", *command]
        if not self.as_root:
            return [self.bwrap, *sandbox]
        tools = [p for p in (self.bwrap, self.setpriv) if not p.startswith("/usr/")]
        reach = [*ro_paths, *tools]
        stage1 = [self.bwrap, "--die-with-parent", "--bind", "/proc", "/proc", "--dev", "/dev",
                  "--tmpfs", "/tmp"]  # bwrap mounts the sandbox's new root on /tmp
        for parent in _parents([*view_paths, *reach]):  # bwrap would make them 0700, closed to nobody
            stage1 += ["--perms", "0755", "--dir", parent]
        stage1 += view
        for path in reach:
            stage1 += ["--ro-bind", path, path]
        drop = [self.setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--"]
        return [*stage1, "--", *drop, self.bwrap, *sandbox]


def explain_failure(stderr: str) -> str:
    """One line for a sandbox that would not start: bubblewrap's own message, and what to allow."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    message = next((line for line in reversed(lines) if line.startswith(("bwrap:", "setpriv:"))),
                   lines[-1] if lines else "no message")
    if re.search(r"namespace|uid map|Operation not permitted|Permission denied|mount proc|No permissions",
                 message, re.IGNORECASE):
        return f"bubblewrap cannot set up the sandbox here ({message}): {USERNS_HINT}"
    return f"bubblewrap cannot set up the sandbox here ({message})"
