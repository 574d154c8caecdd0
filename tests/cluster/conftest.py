"""A two-"host" cluster on this machine, for tests that launch exactly what a cluster user types:

    deepspeed --hostfile F --ssh_port P --master_addr 127.0.0.2 script.py ...

DeepSpeed's default (pdsh) runner first checks `ssh -o PasswordAuthentication=no -p P <first host> hostname`,
then runs `pdsh -S -f 1024 -w 127.0.0.2,127.0.0.3 "export ...; cd CWD; python -u -m deepspeed.launcher.launch
--node_rank=%n ..."` with PDSH_RCMD_TYPE=ssh and PDSH_SSH_ARGS_APPEND="-p P". The fixture below gives it an sshd
of the test's own listening on 127.0.0.2 and 127.0.0.3, and an `ssh` on PATH that logs in with a throwaway key.

Needs `pdsh` and `/usr/sbin/sshd` (Debian packages pdsh, openssh-server): `make cluster-deps` installs them.
"""

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import psutil
import pytest

_ROOT = Path(__file__).resolve().parents[2]

HOSTS = ("127.0.0.2", "127.0.0.3")
SLOTS = 2
MASTER_ADDR = HOSTS[0]
# Set, with a fresh value per fixture, in the environment of every process the fixture or its helpers start,
# and by our sshd (SetEnv) in every remote session: teardown kills exactly the processes that carry it, even
# those re-parented to init when their ssh connection went away.
TOKEN_VAR = "CODEGEEX_LOOPBACK_CLUSTER"
# Variables from the outer environment that would change what pdsh/DeepSpeed do behind the test's back.
_SCRUBBED = ("PDSH_RCMD_TYPE", "PDSH_SSH_ARGS", "PDSH_SSH_ARGS_APPEND", "DS_ENV_FILE")


def _find(name: str, *extra_dirs: str) -> Optional[str]:
    return shutil.which(name, path=os.pathsep.join([*extra_dirs, os.environ.get("PATH", os.defpath)]))


def free_port(hosts=HOSTS) -> int:
    """A TCP port that is free on every one of `hosts` (loopback addresses) at the time of asking."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((hosts[0], 0))
            port = s.getsockname()[1]
        try:
            for host in hosts[1:]:
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.bind((host, port))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no port free on all of {hosts}")


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def _tagged(token: str, exclude=()) -> list:
    """Processes whose environment has TOKEN_VAR=token (ours only: others' environments are unreadable)."""
    me = os.getpid()
    found = []
    for proc in psutil.process_iter(["pid"]):
        if proc.pid == me or proc.pid in exclude:
            continue
        try:
            if proc.environ().get(TOKEN_VAR) == token and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def _kill_tagged(token: str, exclude=()) -> list:
    """SIGKILL every process tagged with `token` (by pid; never by name). Returns what it hit.

    SIGKILL, not SIGTERM: DeepSpeed's runner answers SIGTERM/SIGINT by running `pdsh -w <hosts> pkill -f
    "<python> -u -m deepspeed.launcher.launch"`, which on a loopback cluster would kill every DeepSpeed launch
    of this interpreter on the machine, not only ours."""
    victims = _tagged(token, exclude)
    for proc in victims:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(victims, timeout=10)
    return victims


@dataclass
class LoopbackCluster:
    hosts: tuple
    slots: int
    ssh_port: int
    env: dict  # launch with this: wrapper ssh first on PATH, CPU DeepSpeed, gloo on lo, the teardown token
    workdir: Path  # throwaway dir: keys, configs, the ssh wrapper, sshd's log
    token: str
    sshd_log: Path
    deepspeed: list = field(default_factory=list)  # argv prefix of the `deepspeed` launcher
    sshd_pid: int = 0
    master_addr: str = MASTER_ADDR

    def write_hostfile(self, path) -> Path:
        path = Path(path)
        path.write_text("".join(f"{h} slots={self.slots}\n" for h in self.hosts))
        return path

    def write_deepspeed_env(self, directory, **extra) -> Path:
        """`.deepspeed_env` in `directory` (the launch cwd): the runner forwards only variables starting with
        PYTHON, MLFLOW, MV2, UCX to the hosts; this file carries the rest (one KEY=VALUE a line; DeepSpeed
        strips each value, and wraps one with characters outside [\\w@%+=:,./-] in double quotes). Sets what the
        ranks need on this machine (CPU accelerator, the checkout's JIT cache, gloo on lo, 1 OpenMP thread)."""
        values = {k: self.env[k] for k in ("DS_ACCELERATOR", "TORCH_EXTENSIONS_DIR", "GLOO_SOCKET_IFNAME",
                                           "OMP_NUM_THREADS")}
        values.update({k: str(v) for k, v in extra.items()})
        path = Path(directory) / ".deepspeed_env"
        path.write_text("".join(f"{k}={v}\n" for k, v in values.items()))
        return path

    def deepspeed_cmd(self, hostfile, script, *script_args, master_port: Optional[int] = None,
                      launcher_args=()) -> list:
        """`deepspeed --hostfile F --ssh_port P --master_addr 127.0.0.2 --master_port M [launcher_args] script ...`"""
        port = master_port if master_port is not None else free_port((self.master_addr,))
        return [*self.deepspeed, "--hostfile", str(hostfile), "--ssh_port", str(self.ssh_port), "--master_addr",
                self.master_addr, "--master_port", str(port), *launcher_args, str(script), *map(str, script_args)]

    def run(self, cmd, cwd, timeout: float, env=None) -> subprocess.CompletedProcess:
        """Run `cmd` in a session of its own with this cluster's env. On timeout (or any error while waiting)
        SIGKILL its process group and everything it started on the "hosts", then re-raise. After a failed
        launch (rc != 0), kill what is left of it (ranks on the other host blocked in a collective)."""
        proc = subprocess.Popen(cmd, cwd=str(cwd), env=env or self.env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.kill_launched()
            out, err = proc.communicate(timeout=30)
            print(f"--- launcher stdout (killed) ---\n{out[-5000:]}\n--- launcher stderr ---\n{err[-5000:]}")
            raise
        if proc.returncode != 0:
            self.kill_launched()
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)

    def launched(self, grace: float = 0.0) -> list:
        """Processes launched through this cluster that are still alive (sshd's listener aside), after waiting
        up to `grace` seconds for them to go."""
        deadline = time.monotonic() + grace
        while True:
            procs = _tagged(self.token, exclude=(self.sshd_pid,))
            if not procs or time.monotonic() >= deadline:
                return procs
            time.sleep(0.1)

    def kill_launched(self) -> list:
        """SIGKILL every process launched through this cluster (locally with `env`, or remotely over its sshd)."""
        return _kill_tagged(self.token, exclude=(self.sshd_pid,))


def _require(name: str, path: Optional[str]) -> str:
    if path is None and os.environ.get("CLUSTER_DEPS") == "skip":
        pytest.skip(f"`{name}` not found and CLUSTER_DEPS=skip: the loopback-cluster tests need pdsh and "
                    f"openssh-server (`make cluster-deps` installs them)")
    if path is None:
        pytest.fail(f"`{name}` not found: the loopback-cluster tests need pdsh and openssh-server "
                    f"(openssh-client). Run `make cluster-deps` (apt-get install pdsh openssh-server).",
                    pytrace=False)
    return path


def _deepspeed_argv() -> list:
    # The console script a user types, from the interpreter running the tests (the venv); else the module.
    script = Path(sys.executable).parent / "deepspeed"
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [sys.executable, "-m", "deepspeed.launcher.runner"]


@pytest.fixture(scope="module")
def loopback_cluster(tmp_path_factory):
    """Two "hosts", 127.0.0.2 and 127.0.0.3 (2 slots each), reachable over passwordless ssh on a free port.

    - sshd: our own `sshd -D` child with a throwaway host key, listening on those two addresses only, the
      authorised key read from this fixture's dir (`AuthorizedKeysFile <abs path>`), so ~/.ssh is never read
      or written. `SetEnv` tags every remote session with the fixture's token, which teardown uses to kill
      whatever the test started there.
    - ssh: on a real cluster the user's ~/.ssh/config and key make `ssh host` work without questions. Here a
      directory prepended to PATH holds an `ssh` wrapper that execs the real ssh with `-F <our ssh_config>`
      (IdentityFile, IdentitiesOnly, no host-key checking, BatchMode) and stands in for that config. Both
      callers reach it through PATH: DeepSpeed's runner runs `ssh ... hostname` as its reachability check, and
      pdsh's ssh rcmd module execs `ssh` by name (checked: it runs the wrapper). The port is deliberately NOT
      in the ssh_config: it has to come from `deepspeed --ssh_port` (the check's `-p` and
      PDSH_SSH_ARGS_APPEND), so a test also checks that plumbing.
    - teardown (also when the test fails): SIGKILL every process carrying the token (launchers, pdsh, ssh,
      remote launch.py and ranks), stop sshd, remove the key dir.

    Fails when pdsh or sshd is missing (`make cluster-deps` installs them), or skips with CLUSTER_DEPS=skip.
    """
    _require("pdsh", _find("pdsh"))  # DeepSpeed looks it up on PATH (shutil.which('pdsh'))
    sshd = _require("sshd", _find("sshd", "/usr/sbin", "/usr/local/sbin"))
    ssh = _require("ssh", _find("ssh"))
    keygen = _require("ssh-keygen", _find("ssh-keygen"))

    work = tmp_path_factory.mktemp("loopback_cluster")
    token = uuid.uuid4().hex
    user_key, host_key = work / "id_ed25519", work / "ssh_host_ed25519_key"
    for key in (user_key, host_key):
        subprocess.run([keygen, "-q", "-t", "ed25519", "-N", "", "-C", "codegeex-loopback-test", "-f", str(key)],
                       check=True, stdin=subprocess.DEVNULL, capture_output=True, timeout=30)
    authorized = work / "authorized_keys"
    shutil.copyfile(user_key.with_suffix(".pub"), authorized)
    os.chmod(authorized, 0o600)

    # The privilege-separation dir sshd insists on (root only; CI images often lack it).
    try:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
    except OSError:
        pass

    ssh_config = work / "ssh_config"
    ssh_config.write_text(
        "Host *\n"
        f"  IdentityFile {user_key}\n"
        "  IdentitiesOnly yes\n"
        "  StrictHostKeyChecking no\n"
        "  UserKnownHostsFile /dev/null\n"
        "  GlobalKnownHostsFile /dev/null\n"
        "  BatchMode yes\n"
        "  LogLevel ERROR\n"
        "  ConnectTimeout 10\n"
        "  ForwardAgent no\n"
        "  ForwardX11 no\n"
    )
    bindir = work / "bin"
    bindir.mkdir()
    wrapper = bindir / "ssh"
    wrapper.write_text(f'#!/bin/sh\nexec "{ssh}" -F "{ssh_config}" "$@"\n')
    wrapper.chmod(0o755)

    env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED}
    env.update(
        PATH=os.pathsep.join([str(bindir), str(Path(sys.executable).parent), env.get("PATH", os.defpath)]),
        GLOO_SOCKET_IFNAME="lo",
        DS_ACCELERATOR="cpu",
        TORCH_EXTENSIONS_DIR=os.environ.get("TORCH_EXTENSIONS_DIR", str(_ROOT / ".cache" / "torch_extensions")),
        OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
        **{TOKEN_VAR: token},
    )

    sshd_log = work / "sshd.log"
    sshd_proc = None
    port = None
    try:
        for attempt in range(3):  # the free port can be taken between asking and sshd binding it
            port = free_port()
            config = work / "sshd_config"
            config.write_text(
                f"Port {port}\n"
                + "".join(f"ListenAddress {h}\n" for h in HOSTS)
                + f"HostKey {host_key}\n"
                f"PidFile {work / 'sshd.pid'}\n"
                f"AuthorizedKeysFile {authorized}\n"
                "AuthorizedPrincipalsFile none\n"
                "PubkeyAuthentication yes\n"
                "PasswordAuthentication no\n"
                "KbdInteractiveAuthentication no\n"
                "PermitRootLogin prohibit-password\n"
                "UsePAM no\n"
                "StrictModes no\n"
                "UseDNS no\n"
                "X11Forwarding no\n"
                "AllowTcpForwarding no\n"
                "AllowAgentForwarding no\n"
                "PrintMotd no\n"
                "MaxStartups 64\n"
                f"SetEnv {TOKEN_VAR}={token}\n"
                "LogLevel INFO\n"
            )
            with open(sshd_log, "w") as log:
                sshd_proc = subprocess.Popen([sshd, "-D", "-e", "-f", str(config)], stdin=subprocess.DEVNULL,
                                             stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            # Ready when it says it listens on both (sshd -D -e logs that, or a failed bind, before it accepts):
            # a port can be accepted by someone else's listener on one of the addresses.
            listening = [f"Server listening on {h} port {port}." for h in HOSTS]
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and sshd_proc.poll() is None:
                text = sshd_log.read_text(errors="replace")
                if "Bind to port" in text or all(line in text for line in listening):
                    break
                time.sleep(0.05)
            text = sshd_log.read_text(errors="replace")
            if (sshd_proc.poll() is None and "Bind to port" not in text and all(line in text for line in listening)
                    and all(_accepts(h, port) for h in HOSTS)):
                break
            if sshd_proc.poll() is None:
                sshd_proc.kill()
            sshd_proc.wait()
            sshd_proc = None
            errors = sshd_log.read_text(errors="replace")
            if "Address already in use" not in errors and "Bind to port" not in errors:
                break  # not a port race: trying again will not help
        if sshd_proc is None:
            pytest.fail(f"sshd ({sshd} -D -f <tmp>/sshd_config) did not start listening on port {port} of "
                        f"{' and '.join(HOSTS)} (attempts: {attempt + 1}). Its output:\n{errors[-3000:]}\n"
                        f"Its config:\n{config.read_text()}", pytrace=False)

        # What DeepSpeed's runner checks first, through the wrapper; a clear failure here beats a launcher hang.
        for host in HOSTS:
            check = subprocess.run(["ssh", "-o", "PasswordAuthentication=no", "-p", str(port), host, "hostname"],
                                   env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30)
            if check.returncode != 0:
                pytest.fail(f"passwordless ssh to {host}:{port} through {wrapper} failed (rc {check.returncode}): "
                            f"{check.stderr.strip()}\nsshd log:\n{sshd_log.read_text(errors='replace')[-3000:]}",
                            pytrace=False)

        cluster = LoopbackCluster(hosts=HOSTS, slots=SLOTS, ssh_port=port, env=env, workdir=work, token=token,
                                  sshd_log=sshd_log, deepspeed=_deepspeed_argv(), sshd_pid=sshd_proc.pid)
        yield cluster
    finally:
        _kill_tagged(token, exclude=(sshd_proc.pid,) if sshd_proc is not None else ())
        if sshd_proc is not None:
            sshd_proc.terminate()
            try:
                sshd_proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                sshd_proc.kill()
                sshd_proc.wait()
            # Sessions still open when the listener went (none expected after the kill above) carry the token.
            _kill_tagged(token)
        shutil.rmtree(work, ignore_errors=True)
