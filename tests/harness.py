"""Run a function on N real gloo ranks on CPU: the harness behind every distributed test.

    results = run_distributed(check_layer, world_size=4, tp_size=2, hidden=16)

spawns 4 processes on a free port, builds the Topology in each, calls ``check_layer(topology, hidden=16)``
on every rank and returns the per-rank return values. Any rank's exception fails the call with that
rank's traceback; every collective has a timeout and the whole run a deadline, so a broken test fails
instead of hanging CI. ``fn`` must be a module-level function (it is pickled into the spawned ranks). Return plain
values or numpy arrays: a torch tensor put on the results queue as it is would come back as a shared-memory handle
that can vanish with its rank before the parent reads it (FileNotFoundError in multiprocessing's resource_sharer),
so every tensor in the result (also inside lists, tuples and dicts) is turned into a numpy array in the rank
(detached, on the CPU; a dtype numpy lacks, e.g. bfloat16, as float32) before it is sent.

``run_process_group`` runs a launcher (deepspeed, torchrun, a shell script) in a session of its own and, on
timeout, kills its whole process group: ``subprocess.run(timeout=...)`` kills only the launcher and leaves its
ranks running. Below those, what many tests repeat (the tiny model's flags, metrics records, ``fails_with``).

It lives beside the tests, not in the package (which ships no pytest harness): ``from tests.harness import ...``
with the checkout's root on sys.path (tests/conftest.py puts it there; the benchmarks that spawn ranks too). Spawned
ranks import it by that name: they get the caller's sys.path.
"""

from __future__ import annotations

import contextlib
import os
import queue as queue_lib
import signal
import socket
import sys
import subprocess
import time
import traceback
from datetime import timedelta
from multiprocessing import reduction
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from codegeex_train.distributed.topology import ParallelDims, Topology


class RankFailure(AssertionError):
    """One or more ranks raised (or hung); the message carries their tracebacks."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def numpy_results(value: Any) -> Any:
    """``value`` with every torch tensor in it (also inside lists, tuples and dicts) replaced by a numpy array: what a
    rank sends back. Detached and on the CPU; a dtype numpy lacks (bfloat16, ...) becomes float32."""
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu()
        try:
            return tensor.numpy().copy()
        except TypeError:  # no numpy dtype for it
            return tensor.float().numpy().copy()
    if isinstance(value, dict):
        return {k: numpy_results(v) for k, v in value.items()}  # a plain dict (also for dict subclasses)
    if isinstance(value, list):
        return [numpy_results(v) for v in value]
    if isinstance(value, tuple) and not isinstance(value, torch.Size):
        items = [numpy_results(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)  # namedtuples keep their type
    return value


# Ranks are forked from a server process that has imported these once (multiprocessing's "forkserver"): a rank then
# starts in ~0.05 s instead of the ~3 s a fresh interpreter needs to import torch and DeepSpeed (a few hundred
# distributed runs in the suite). Like "spawn" (and unlike "fork") nothing of the test process is inherited but
# what is pickled over: the function, its arguments, sys.path, the working directory, and (below) the environment
# and the caller's stdout / stderr as they are now (pytest's capfd replaces them per test; the server keeps the
# ones it started with).
# torch._dynamo and symbolic_shapes: imported lazily in every rank's first training step (3.5-4 s of CPU each); the
# muon module: DeepSpeed's optimizer sanity check imports it in every rank's first engine, and its import runs
# torch.compile (~3.4 s a rank). (The forkserver skips a module that does not import, e.g. another DeepSpeed.)
_PRELOAD = ["torch", "deepspeed", "codegeex_train.pretrain", "torch._dynamo", "torch.fx.experimental.symbolic_shapes",
            "deepspeed.runtime.zero.muon.muon_optimizer"]


class _Stdio:
    """The caller's file descriptors 1 and 2, handed to a rank through the forkserver (``reduction.DupFd``, which
    works only while a process is being started)."""

    def __reduce__(self):
        return _Stdio._attach, (reduction.DupFd(1), reduction.DupFd(2))

    @staticmethod
    def _attach(out, err) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        for target, dup in ((1, out), (2, err)):
            fd = dup.detach()
            os.dup2(fd, target)
            os.close(fd)


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # read when the server starts, at the first run
    return ctx


def _worker(rank: int, dims: ParallelDims, port: int, fn: Callable, kwargs: dict, results, collective_timeout: float,
            environ: dict[str, str], stdio: None):
    # (stdio: unpickling it already pointed fds 1 and 2 at the caller's)
    os.environ.clear()  # the caller's environment now, not the server's from when it started
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(dims.world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)  # N ranks share the cores; oversubscription only slows every rank
    timeout = timedelta(seconds=collective_timeout)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=dims.world_size, timeout=timeout)
        topology = Topology(dims, rank=rank, timeout=timeout)
        results.put((rank, None, numpy_results(fn(topology, **kwargs))))
    except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
        results.put((rank, traceback.format_exc(), None))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run_once(fn, dims: ParallelDims, kwargs: dict, deadline_s: float, collective_timeout_s: float) -> list[Any]:
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    environ = dict(os.environ)
    procs = [
        ctx.Process(target=_worker, args=(r, dims, port, fn, kwargs, results, collective_timeout_s, environ,
                                                     _Stdio()),
                    daemon=True)
        for r in range(dims.world_size)
    ]
    for p in procs:
        p.start()
    outcomes: dict[int, tuple[str | None, Any]] = {}
    deadline = time.monotonic() + deadline_s
    try:
        while len(outcomes) < dims.world_size and time.monotonic() < deadline:
            try:
                rank, error, value = results.get(timeout=0.2)
            except queue_lib.Empty:
                # A rank that died without reporting (killed, os._exit) fails the run now, not at the deadline.
                dead = [r for r, p in enumerate(procs) if r not in outcomes and p.exitcode is not None]
                while dead and not results.empty():  # a report may have landed just before the exit
                    rank, error, value = results.get(timeout=1.0)
                    outcomes[rank] = (error, value)
                dead = [r for r in dead if r not in outcomes]
                for r in dead:
                    outcomes[r] = (f"process exited with code {procs[r].exitcode} without reporting", None)
                if dead:
                    deadline = min(deadline, time.monotonic() + 3.0)
                continue
            outcomes[rank] = (error, value)
            if error is not None:
                # Peers of a failed rank block in collectives; give them a moment to report, then stop.
                deadline = min(deadline, time.monotonic() + 3.0)
    finally:
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()) if len(outcomes) == dims.world_size else 0)
            if p.is_alive():
                p.kill()
                p.join()
    failures = [f"--- rank {r} ---\n{err}" for r, (err, _) in sorted(outcomes.items()) if err]
    missing = [r for r in range(dims.world_size) if r not in outcomes]
    if failures or missing:
        hung = f"ranks {missing} did not finish within {deadline_s:.0f} s (killed)\n" if missing else ""
        raise RankFailure(hung + "\n".join(failures))
    return [outcomes[r][1] for r in range(dims.world_size)]


def run_distributed(fn: Callable[..., Any], world_size: int, tp_size: int = 1, pp_size: int = 1, *,
                    cp_size: int = 1, deadline_s: float = 180.0, collective_timeout_s: float = 60.0,
                    **kwargs) -> list[Any]:
    """Run ``fn(topology, **kwargs)`` on ``world_size`` gloo ranks; return each rank's result."""
    dims = ParallelDims(world_size, tp_size, pp_size, cp_size)
    for attempt in range(3):
        try:
            return _run_once(fn, dims, kwargs, deadline_s, collective_timeout_s)
        except RankFailure as e:
            # Another process may grab the free port between our probe and rank 0's bind: retry.
            if "Address already in use" not in str(e) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def run_process_group(cmd, *, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, timeout=timeout, **kwargs)``, but the command starts a session (and process group) of
    its own and, on timeout, the whole group is SIGKILLed (the launcher and every rank or child it started that
    stayed in the group) before ``subprocess.TimeoutExpired`` is raised. Output passes through as with
    ``subprocess.run`` (``capture_output``, ``text``, ``check``, ``cwd``, ``env`` ...)."""
    check = kwargs.pop("check", False)
    input_ = kwargs.pop("input", None)
    if kwargs.pop("capture_output", False):
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    if input_ is not None:
        kwargs["stdin"] = subprocess.PIPE
    with subprocess.Popen(cmd, start_new_session=True, **kwargs) as proc:
        try:
            stdout, stderr = proc.communicate(input_, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            _kill_group(proc)
            try:  # what it wrote before; a process that left the group may still hold the pipes: do not wait on it
                e.stdout, e.stderr = proc.communicate(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            raise
        except BaseException:
            _kill_group(proc)
            raise
    result = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    if check:
        result.check_returncode()
    return result


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc``'s process group (its pid: it leads a session of its own), then reap ``proc``."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def load_tool(name: str):
    """``tools/<name>.py`` of this checkout as a module (tools/ is not a package), e.g. to call its main()."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "tools" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def codegeex_reference(module: str = "codegeex.torch.codegeex_model"):
    """A module of the original ``codegeex`` 1.0 package (the tests' independent reference), or a test failure
    that says how to install it: the reference must never be skipped silently."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        import pytest

        pytest.fail(f"the codegeex package is not installed ({e}); `make env` installs it: "
                    f"pip install --no-deps codegeex==1.0", pytrace=False)


# --- What many tests repeat ----------------------------------------------------------------------------

def tiny_model_args(num_layers: int = 2, hidden_size: int = 32, num_attention_heads: int = 4, seq_length: int = 32,
                    max_position_embeddings: int = 64) -> list[str]:
    """The model-shape flags of the suite's tiny model (seconds per run on CPU), to extend with a run's flags."""
    return ["--num-layers", str(num_layers), "--hidden-size", str(hidden_size), "--num-attention-heads",
            str(num_attention_heads), "--seq-length", str(seq_length), "--max-position-embeddings",
            str(max_position_embeddings)]


# Set to 1, every run built by tiny_pretrain_args saves with --async-save: the checkpoint tests, run once so, check
# that background saves are interchangeable with sync ones (docs/checkpoints.md).
TEST_ASYNC_SAVE_ENV = "CODEGEEX_TEST_ASYNC_SAVE"


def tiny_pretrain_args(data, save, iters: int = 20, *extra: str) -> list[str]:
    """``pretrain.main``'s flags for a short run of the tiny model on the indexed dataset ``data``, saving to
    ``save``: global batch 8 in micro-batches of 2, no dropout, a log record every iteration, seed 7; ``extra``
    flags come last (and win). ``TEST_ASYNC_SAVE_ENV``=1 adds --async-save."""
    background = ["--async-save"] if os.environ.get(TEST_ASYNC_SAVE_ENV) == "1" else []
    return [*tiny_model_args(), "--micro-batch-size", "2", "--global-batch-size", "8",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "2e-3", "--lr-warmup-iters", "2",
            "--train-iters", str(iters), "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1",
            "--data-path", data, "--split", "90,9,1", "--seed", "7", "--save", save, "--no-progress-bar",
            "--num-workers", "0", *background, *extra]


def run_pretrain(topology, argv: list[str]) -> None:
    """A rank's body for ``run_distributed``: ``pretrain.main(argv)`` on the rank's process group."""
    from codegeex_train.pretrain import main

    main(argv)


def read_metrics(run_dir) -> list[dict]:
    """Every record of ``run_dir``/metrics.jsonl, in the order written (all splits, metadata too)."""
    import json
    from pathlib import Path

    with open(Path(run_dir) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def metrics_records(run_dir, split: str = "train") -> dict[int, dict]:
    """One split's records of ``run_dir``/metrics.jsonl by iteration ("train", "valid", "test", ...); an iteration
    logged twice (a run resumed into the same directory) keeps its last record."""
    return {r["iteration"]: r for r in read_metrics(run_dir) if r.get("split", "train") == split}


def worst_relative(run: dict[int, dict], base: dict[int, dict], key: str) -> float:
    """The largest relative difference of metric ``key`` between two runs' records, over the iterations ``run``
    logged (``metrics_records`` of each)."""
    return max(abs(run[it][key] / base[it][key] - 1) for it in run)


def checkpoint_at(run_dir, out, iteration: int) -> str:
    """A copy of run ``run_dir`` in ``out`` whose ``latest`` names ``iteration`` and that holds no metrics.jsonl:
    what a run stopped after that iteration would have left (for resume tests)."""
    import shutil

    from codegeex_train.checkpoint.files import checkpoint_tag, write_latest

    shutil.copytree(run_dir, out)
    os.remove(os.path.join(out, "metrics.jsonl"))
    write_latest(out, checkpoint_tag(iteration))
    return str(out)


def write_indexed_dataset(prefix, documents, dtype=None) -> None:
    """PREFIX.bin/.idx holding ``documents`` (sequences of token ids), one document each, in ``dtype``
    (default int32): small hand-made corpora for the data and training tests."""
    import numpy as np

    from codegeex_train.data.indexed_dataset import IndexedDatasetBuilder

    dtype = np.int32 if dtype is None else dtype
    with IndexedDatasetBuilder(str(prefix), dtype) as builder:
        for doc in documents:
            builder.add_document(np.asarray(doc, dtype=dtype))


def another_tokenizer(directory, name: str = "tokenizer.json") -> str:
    """``directory/name``: the shipped tokenizer with two ordinary tokens' ids swapped, so the same 8192 ids (the
    same padded vocabulary) that mean other tokens: a different tokenizer only its fingerprint tells apart."""
    import json
    from pathlib import Path

    from codegeex_train.data.tokenizer import DEFAULT_TOKENIZER_PATH

    backend = json.loads(Path(DEFAULT_TOKENIZER_PATH).read_text(encoding="utf-8"))
    vocab = backend["model"]["vocab"]
    first, second = (token for token, i in vocab.items() if i in (300, 301))
    vocab[first], vocab[second] = vocab[second], vocab[first]
    path = Path(directory) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(backend), encoding="utf-8")
    return str(path)


def all_gather_tensor(tensor: torch.Tensor, group=None, dim: int | None = None):
    """Every rank's ``tensor`` (same shape everywhere) in group-rank order: a list, or concatenated along ``dim``
    (e.g. TP shards back into the full tensor)."""
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return parts if dim is None else torch.cat(parts, dim=dim)


@contextlib.contextmanager
def deadline(seconds: int):
    """Fail (instead of hanging the suite, e.g. on a FIFO whose open waits for a writer) when the body runs longer
    than ``seconds``. Main thread only (SIGALRM)."""
    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s: hung")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def fails_with(capsys, argv: list[str], *fragments: str) -> str:
    """``pretrain.main(argv)`` refuses: exit 2, exactly one stderr line ``error: ...`` holding every fragment, and no
    process group created. Returns the line (the bad-input tests' shared assertion)."""
    import pytest

    from codegeex_train import pretrain

    with pytest.raises(SystemExit) as e:
        pretrain.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    for fragment in fragments:
        assert fragment in err[0], err[0]
    assert not dist.is_initialized()
    return err[0]


def leaks(data: bytes, secrets: dict[str, str]) -> set[str]:
    """The names of the ``secrets`` ({name: value}) whose value is in ``data``."""
    return {name for name, value in secrets.items() if value.encode() in data}


def scan(roots, secrets: dict[str, str]) -> dict[str, set[str]]:
    """{file: names of the ``secrets`` found in it} under ``roots`` (files or directories): the credential tests'
    search of everything a run wrote. Zip files (torch.save's format) are searched in each member as stored and
    decompressed too."""
    import zipfile
    from pathlib import Path

    found = {}
    for root in map(Path, roots):
        for path in [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file()):
            hits = leaks(path.read_bytes(), secrets)
            if zipfile.is_zipfile(path):
                with zipfile.ZipFile(path) as archive:
                    for member in archive.namelist():
                        hits |= leaks(archive.read(member), secrets)
            if hits:
                found[str(path)] = hits
    return found
