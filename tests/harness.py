"""What the tests share: real gloo ranks on CPU, launchers under a deadline, and what many tests repeat.

    results = run_distributed(check_layer, world_size=4, tp_size=2, hidden=16)

spawns 4 processes on a free port, builds the Topology in each, calls ``check_layer(topology, hidden=16)`` on every
rank and returns the per-rank return values (``plan=`` instead of the sizes: the ranks laid out as a
``ParallelPlan``'s dims, which ``fn`` gets too). The machinery (``spawn.run_distributed``, ``RankFailure``,
``free_port``, ``numpy_results``) lives in the package (``codegeex_train/distributed/spawn.py``, which says what a
rank may return, and takes the layout as a ``ParallelDims`` or a plan), so that the benchmarks that start their own
ranks use it without reaching into tests/; here the tests' spelling by sizes.

``run_process_group`` runs a launcher (deepspeed, torchrun, a shell script) in a session of its own and, on
timeout, kills its whole process group: ``subprocess.run(timeout=...)`` kills only the launcher and leaves its
ranks running. Below those, what many tests repeat (the tiny model's flags, metrics records, ``fails_with``).

It lives beside the tests, not in the package (which ships no pytest harness): ``from tests.harness import ...``
with the checkout's root on sys.path (tests/conftest.py puts it there). Spawned ranks import a test module's
function by its name: they get the caller's sys.path.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess

import torch
import torch.distributed as dist

from codegeex_train.distributed import spawn
from codegeex_train.layout.dims import ParallelDims
from codegeex_train.layout.plan import ParallelPlan
from codegeex_train.distributed.spawn import RankFailure, free_port, numpy_results  # noqa: F401


def run_distributed(fn, world_size: int | None = None, tp_size: int = 1, pp_size: int = 1, *, cp_size: int = 1,
                    plan: ParallelPlan | None = None, **kwargs) -> list:
    """``spawn.run_distributed`` with the layout given by its sizes (the world and TP / PP / CP), or by a ``plan``
    (then ``fn`` gets it too); the other keywords are ``spawn.run_distributed``'s and ``fn``'s."""
    if plan is None:
        if world_size is None:
            raise TypeError("run_distributed: give world_size (and the TP/PP/CP sizes) or a plan")
        return spawn.run_distributed(fn, ParallelDims(world_size, tp_size, pp_size, cp_size), **kwargs)
    if world_size is not None or (tp_size, pp_size, cp_size) != (1, 1, 1):
        raise TypeError("run_distributed: give a plan or the sizes, not both (the plan's dims are the sizes)")
    return spawn.run_distributed(fn, plan, **kwargs)


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

    from codegeex_train.tokenization.tokenizer import DEFAULT_TOKENIZER_PATH

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
    """``pretrain.main(argv)`` refuses: exit 2, exactly one stderr line ``error: ...`` holding every fragment, no
    traceback on either stream, and no process group created or even asked for (a run that gets as far as
    ``init_distributed`` fails the test at once instead of waiting for ranks that never come). Returns the line (the
    bad-input tests' shared assertion)."""
    import pytest

    from codegeex_train import pretrain

    def joined(*args, **kwargs):
        raise AssertionError("the preflight let it through: the run went on to join a process group")

    with pytest.MonkeyPatch.context() as patch, pytest.raises(SystemExit) as e:
        patch.setattr(pretrain, "init_distributed", joined)
        pretrain.main(argv)
    assert e.value.code == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in out + err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert not dist.is_initialized()
    return lines[0]


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
