"""The parent's side of the GPU check: each unit in a process of its own session (``benchmarks/gpu.py --child UNIT``)
under a wall-clock budget, killed at the budget or when the parent is signalled; what it measured is read back from
its state file whatever happened."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu.py"  # a unit runs as this script with --child UNIT


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(device: str) -> dict:
    env = dict(os.environ)
    env["DS_ACCELERATOR"] = "cpu" if device == "cpu" else "cuda"
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    if device == "cpu":
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    else:
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    # A world of one per unit, whatever launched us.
    for key in ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        env.pop(key, None)
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    return env


_RUNNING: list[subprocess.Popen] = []  # the unit's process (its own session: a signal to us does not reach it)


class Interrupted(Exception):
    def __init__(self, signum: int):
        super().__init__(f"interrupted by signal {signum}")
        self.signum = signum


def on_signal(signum, frame) -> None:
    for proc in _RUNNING:
        _kill(proc)
    raise Interrupted(signum)


def _kill(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(path: Path, lines: int = 3) -> str:
    try:
        text = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return " | ".join(text[-lines:])[-400:]


def _read_state(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {"data": {}, "notes": []}


def run_unit(unit: str, argv: list[str], a, budget: float, out_dir: Path) -> dict:
    """Run one unit in a child process within ``budget`` seconds; its state (data, notes, error) plus how it ended.
    A (c) unit that runs out of memory is retried once at half the micro-batch within the same budget."""
    start = time.monotonic()
    log_path = out_dir / "logs" / f"{unit}.log"
    state_path = out_dir / "logs" / f"{unit}.state.json"
    extra: list[str] = []
    attempts: list[dict] = []
    while True:
        remaining = budget - (time.monotonic() - start)
        if state_path.exists():
            state_path.unlink()
        cmd = [sys.executable, str(SCRIPT), *argv, "--child", unit, "--child-state", str(state_path),
               "--child-deadline", str(time.time() + max(1.0, remaining - 8.0)), *extra]
        env = child_env(a.device)
        env["MASTER_PORT"] = str(free_port())
        with open(log_path, "a") as log:
            log.write(f"\n$ {' '.join(cmd)}\n")
            log.flush()
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    cwd=str(ROOT), start_new_session=True)
            _RUNNING.append(proc)
            timed_out = False
            try:
                rc = proc.wait(timeout=max(1.0, remaining))
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill(proc)
                rc = proc.returncode
            except Interrupted as e:  # its process is down (_on_signal): hand up what it had measured
                e.state = _read_state(state_path)
                e.state.update(seconds=time.monotonic() - start, log=str(log_path.relative_to(out_dir)),
                               error=f"{e} while running (its process was stopped)")
                raise
            finally:
                _RUNNING.remove(proc)
        state = _read_state(state_path)
        state.update(rc=rc, seconds=time.monotonic() - start, log=str(log_path.relative_to(out_dir)))
        if timed_out:
            state["timeout"] = True
            state["error"] = f"over its {budget:.0f} s budget (killed)"
        elif rc != 0 and not state.get("error"):
            state["error"] = f"exit status {rc}: {_tail(log_path)}"
        flag = "--c-recompute-micro-batch-size" if unit == "c-recompute" else "--c-micro-batch-size"
        mb = state.get("data", {}).get("micro_batch_size")
        if (state.get("oom") and unit.startswith("c") and not attempts and mb and mb > 1
                and budget - (time.monotonic() - start) > 20):
            attempts.append({"micro_batch_size": mb, "error": state.get("error")})
            extra = [flag, str(mb // 2)]
            continue
        state["attempts"] = attempts
        return state
