"""Running ``scripts/pretrain_codegen.sh`` and the launchers as a user would, and finding their ranks."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from tests.harness import free_port, read_metrics

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "pretrain_codegen.sh"

TINY_MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
              "--max-position-embeddings", "64", "--lr-warmup-iters", "2", "--log-interval", "1",
              "--eval-interval", "1000", "--eval-iters", "1", "--seed", "7", "--no-progress-bar"]


def script_env(output_dir, data, *, train_iters, tp=1, ranks=2, base=None, **more):
    """The environment of ``bash scripts/pretrain_codegen.sh`` for a tiny CPU run (on top of ``base``)."""
    base = os.environ if base is None else base
    venv_bin = str(Path(sys.executable).parent)  # the `deepspeed` console script lives beside python
    return {**base, "PATH": venv_bin + os.pathsep + base["PATH"], "PYTHON": sys.executable,
            "OUTPUT_DIR": str(output_dir), "DEVICE": "cpu", "NUM_GPUS": str(ranks), "TP": str(tp),
            "DATA_PATH": data, "SEQ_LENGTH": "32", "MICRO_BATCH": "2", "GLOBAL_BATCH": "8",
            "TRAIN_ITERS": str(train_iters), "LAUNCHER_ARGS": f"--master_addr 127.0.0.1 --master_port {free_port()}",
            "GLOO_SOCKET_IFNAME": "lo", **more}


def start_script(env, *args) -> subprocess.Popen:
    """Start the script in its own session (so a failing test can stop everything it started)."""
    return subprocess.Popen(["bash", str(SCRIPT), *TINY_MODEL, *args], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = 300) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_session(proc)
        out, _ = proc.communicate()
        raise AssertionError(f"still running after {timeout:.0f} s:\n{out[-4000:]}") from None
    return out


def stop_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def rank_pids(marker: str) -> dict[int, int]:
    """{local rank: pid} of the training processes whose command line contains ``marker`` (the ranks
    themselves, not their DataLoader workers, which share the command line but are the ranks' children)."""
    candidates = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if any(marker in a for a in argv) and any(a.endswith("codegeex_train/pretrain.py") for a in argv):
            local = next((a.split("=", 1)[1] for a in argv if a.startswith("--local_rank=")), None)
            if local is not None:
                candidates[int(entry.name)] = (int(local), ppid)
    return {local: pid for pid, (local, ppid) in candidates.items() if ppid not in candidates}


def job_processes(marker: str) -> list[int]:
    """Live processes (zombies aside) whose command line contains ``marker``: ranks, their DataLoader workers, tee."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if marker in argv and state != "Z":
            found.append(int(entry.name))
    return found


# DeepSpeed's per-node launcher, signalled, terminates its ranks and collects their exit codes without printing them
# (launch.py: terminate_process_tree -> psutil.wait_procs). A sitecustomize on PYTHONPATH makes it print them.
_REAPED_REPORTER = """\
import psutil

_wait_procs = psutil.wait_procs


def _reporting_wait_procs(procs, *args, **kwargs):
    gone, alive = _wait_procs(procs, *args, **kwargs)
    for proc in gone:
        print(f"reaped pid={proc.pid} returncode={getattr(proc, 'returncode', None)}", flush=True)
    return gone, alive


psutil.wait_procs = _reporting_wait_procs
"""


def reaped_exit_codes_reporter(directory) -> str:
    """A PYTHONPATH value under which a signalled DeepSpeed launcher prints ``reaped pid=P returncode=R`` for each
    process it terminated (R: the exit code of its children, the ranks; None for their children)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(_REAPED_REPORTER)
    return os.pathsep.join(p for p in (str(directory), os.environ.get("PYTHONPATH", "")) if p)


def reaped_exit_codes(log: str) -> dict[int, str]:
    return {int(pid): code for pid, code in re.findall(r"^reaped pid=(\d+) returncode=(\S+)$", log, re.MULTILINE)}


def wait_for_latest(output_dir, at_least: int, proc: subprocess.Popen, timeout: float = 240) -> int:
    """Block until ``latest`` names iteration >= ``at_least``; returns it."""
    latest = Path(output_dir) / "latest"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if latest.exists():
            iteration = int(latest.read_text().strip().removeprefix("iter_"))
            if iteration >= at_least:
                return iteration
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (code {proc.returncode}) before iteration {at_least}:\n"
                                 f"{proc.stdout.read()[-4000:]}")
        time.sleep(0.02)
    raise AssertionError(f"no checkpoint at iteration >= {at_least} within {timeout:.0f} s")


def train_losses(output_dir) -> dict[int, float]:
    return {r["iteration"]: r["loss"] for r in read_metrics(output_dir) if r["split"] == "train"}


def final_weights(output_dir) -> dict[str, torch.Tensor]:
    """Every model-parallel rank's weights of the checkpoint ``latest`` names, keyed by file and name."""
    tag = (Path(output_dir) / "latest").read_text().strip()
    weights = {}
    for path in sorted((Path(output_dir) / tag).glob("mp_rank_*_model_states.pt")):
        module = torch.load(path, map_location="cpu", weights_only=False)["module"]
        weights.update({f"{path.name}:{k}": v for k, v in module.items()})
    assert weights, f"no model files in {output_dir}/{tag}"
    return weights
