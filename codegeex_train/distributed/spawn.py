"""Run a function on N real gloo ranks on this host: the spawner behind every distributed test and the benchmarks
that start their own ranks (no launcher).

    results = run_distributed(check_layer, world_size=4, tp_size=2, hidden=16)
    results = run_distributed(train_step, plan=plan, steps=2)  # the ranks laid out as plan.dims; fn gets the plan

starts 4 processes on a free port, builds the Topology in each, calls ``check_layer(topology, hidden=16)`` on every
rank and returns the per-rank return values. Any rank's exception fails the call (``RankFailure``) with that rank's
traceback; every collective has a timeout and the whole run a deadline, so a broken rank fails the caller instead of
hanging it. ``fn`` must be a module-level function (it is pickled into the ranks). Return plain values or numpy
arrays: a torch tensor put on the results queue as it is would come back as a shared-memory handle that can vanish
with its rank before the parent reads it (FileNotFoundError in multiprocessing's resource_sharer), so every tensor in
the result (also inside lists, tuples and dicts) is turned into a numpy array in the rank (detached, on the CPU; a
dtype numpy lacks, e.g. bfloat16, as float32) before it is sent.

The ranks get the caller's sys.path (a test module's function imports in them by its name); tests reach all this
through tests/harness.py.
"""

from __future__ import annotations

import os
import queue as queue_lib
import socket
import sys
import time
import traceback
from datetime import timedelta
from multiprocessing import reduction
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from codegeex_train.distributed.topology import Topology
from codegeex_train.layout.dims import ParallelDims
from codegeex_train.layout.plan import ParallelPlan

__all__ = ["RankFailure", "free_port", "numpy_results", "run_distributed"]


class RankFailure(AssertionError):
    """One or more ranks raised (or hung); the message carries their tracebacks."""


def free_port() -> int:
    """A TCP port free on this host now (rank 0 binds it a moment later: ``run_distributed`` retries if it is
    taken in between)."""
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
# distributed runs in the test suite). Like "spawn" (and unlike "fork") nothing of the caller is inherited but
# what is pickled over: the function, its arguments, sys.path, the working directory, and (below) the environment
# and the caller's stdout / stderr as they are now (pytest's capfd replaces them per test; the server keeps the
# ones it started with).
# torch._dynamo and symbolic_shapes: imported lazily in every rank's first training step (3.5-4 s of CPU each); the
# muon module: DeepSpeed's optimizer sanity check imports it in every rank's first engine, and its import runs
# torch.compile (~3.4 s a rank). (The forkserver skips a module that does not import, e.g. another DeepSpeed.) The
# entry point is named, not imported: the server imports it, this module stays below it.
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


def run_distributed(fn: Callable[..., Any], ranks: ParallelDims | ParallelPlan, *, deadline_s: float = 180.0,
                    collective_timeout_s: float = 60.0, **kwargs) -> list[Any]:
    """Run ``fn(topology, **kwargs)`` on gloo ranks laid out as ``ranks`` says (a ``ParallelDims``, or a
    ``ParallelPlan``'s dims, and then ``fn`` gets the plan too: ``fn(topology, plan=plan, **kwargs)``); return each
    rank's result."""
    if isinstance(ranks, ParallelPlan):
        dims, kwargs = ranks.dims, {"plan": ranks, **kwargs}
    else:
        dims = ranks
    for attempt in range(3):
        try:
            return _run_once(fn, dims, kwargs, deadline_s, collective_timeout_s)
        except RankFailure as e:
            # Another process may grab the free port between our probe and rank 0's bind: retry.
            if "Address already in use" not in str(e) or attempt == 2:
                raise
    raise AssertionError("unreachable")
