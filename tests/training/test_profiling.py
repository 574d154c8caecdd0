"""--profile's window and --record-memory-history, on a toy model with no process group: which iterations a trace
holds (Megatron's start+1 .. end, named by the logged iteration), a resumed or cut-short run, the CPU warning; and the
flags refused before any process group. (A real run's trace of iterations 3-4: tests/training/test_mfu.py.)"""

import json
import logging

import pytest
import torch

from codegeex_train import pretrain
from codegeex_train.config.arguments import ConfigError, parse_args
from codegeex_train.training.profiling import Profiling
from tests.harness import tiny_pretrain_args

CPU = torch.device("cpu")


def train_toy(profiling: Profiling, iterations: range) -> None:
    """What the loop does around each step: a forward and backward of a toy model in ``step``, then ``after_step``."""
    embedding, linear = torch.nn.Embedding(10, 8), torch.nn.Linear(8, 8)
    for it in iterations:
        with profiling.step(it):
            linear(embedding(torch.tensor([1, 2, 3]))).sum().backward()
        profiling.after_step(it)


def traced_steps(trace_dir) -> list[list[str]]:
    """The ProfilerStep# names of each trace file written into ``trace_dir``."""
    return [sorted(e["name"] for e in json.loads(path.read_text())["traceEvents"]
                   if e.get("name", "").startswith("ProfilerStep#"))
            for path in sorted(trace_dir.glob("rank0.*.pt.trace.json"))]


@pytest.mark.parametrize("first,last,expected", [
    (1, 8, ["ProfilerStep#3", "ProfilerStep#4", "ProfilerStep#5"]),  # the whole window, set up after iteration 2
    (4, 8, ["ProfilerStep#4", "ProfilerStep#5"]),  # resumed inside the window
    (1, 3, ["ProfilerStep#3"]),  # cut short (a preemption stop, --exit-interval): close() writes what it has
], ids=["window", "resumed-inside", "cut-short"])
def test_the_trace_holds_iterations_start_plus_one_to_end(tmp_path, first, last, expected):
    profiling = Profiling(start=2, end=5, device=CPU, rank=0, trace_dir=str(tmp_path))
    train_toy(profiling, range(first, last + 1))
    profiling.close()
    profiling.close()  # pretrain.main's finally after the loop's own close: nothing more
    assert traced_steps(tmp_path) == [expected]


def test_memory_history_on_cpu_is_one_warning_and_nothing_written(tmp_path, caplog):
    args = parse_args(["--data-path", "x", "--record-memory-history", "--save", str(tmp_path)])
    with caplog.at_level(logging.WARNING, logger="codegeex_train.training.profiling"):
        profiling = Profiling.from_config(args.logging, str(tmp_path), 0, CPU)
    assert [r.getMessage() for r in caplog.records] == [
        "--record-memory-history: this run's device is cpu; allocation history needs CUDA, so no memory snapshot is "
        "written"]
    profiling.begin()
    train_toy(profiling, range(1, 14))
    profiling.close()
    assert list(tmp_path.iterdir()) == []
    assert Profiling.from_config(args.logging, str(tmp_path), 1, CPU) is None  # not one of --profile-ranks


def test_snapshot_paths_name_the_rank_when_several_ranks_dump():
    cuda = torch.device("cuda", 0)  # only named: nothing is recorded before begin()
    one = parse_args(["--data-path", "x", "--record-memory-history", "--tensorboard-dir", "tb"]).logging
    assert Profiling.from_config(one, None, 0, cuda).snapshot_path == "tb/profile/memory_snapshot_rank0.pickle"
    two = parse_args(["--data-path", "x", "--record-memory-history", "--memory-snapshot-path", "m/snap.pickle",
                      "--profile-ranks", "0", "3"]).logging
    assert Profiling.from_config(two, None, 3, cuda).snapshot_path == "m/snap_rank3.pickle"
    assert Profiling.from_config(two, None, 0, cuda).trace_dir is None  # no --profile: no trace


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA kernels and memory history need a GPU")
def test_on_a_gpu_the_trace_has_kernels_and_the_snapshot_the_allocations(tmp_path):
    import pickle

    device = torch.device("cuda", torch.cuda.current_device())
    profiling = Profiling(start=1, end=2, device=device, rank=0, trace_dir=str(tmp_path / "profile"),
                          snapshot_path=str(tmp_path / "snap.pickle"))
    profiling.begin()
    linear = torch.nn.Linear(256, 256, device=device)
    for it in range(1, 4):
        with profiling.step(it):
            linear(torch.randn(64, 256, device=device)).sum().backward()
        profiling.after_step(it)
    profiling.close()
    (trace,) = (tmp_path / "profile").glob("rank0.*.pt.trace.json")
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events)  # ProfilerActivity.CUDA
    assert [e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")] == ["ProfilerStep#2"]
    with open(tmp_path / "snap.pickle", "rb") as f:
        snapshot = pickle.load(f)
    assert snapshot["segments"] and any(t for t in snapshot["device_traces"])  # allocations, with their history


@pytest.mark.parametrize("flags,error", [
    (["--profile", "--profile-step-start", "4", "--profile-step-end", "4"],
     "--profile-step-start 4 must be below --profile-step-end 4"),
    (["--profile", "--profile-ranks", "0", "2"], "--profile-ranks 2: this run has ranks 0..1 (world size 2)"),
    (["--record-memory-history", "--profile-ranks", "5"], "--profile-ranks 5: this run has ranks 0..1"),
    (["--memory-snapshot-path", "snap.pickle"], "--memory-snapshot-path goes with --record-memory-history"),
])
def test_bad_profiling_flags_are_one_line(flags, error):
    with pytest.raises(ConfigError) as e:
        parse_args(["--data-path", "x", "--save", "s", *flags]).logging.check(2, "s")
    assert str(e.value).startswith(error) and "\n" not in str(e.value)


def test_profiling_needs_somewhere_to_write():
    logging_config = parse_args(["--data-path", "x", "--profile"]).logging
    with pytest.raises(ConfigError, match="--profile writes into <tensorboard-dir or save>/profile/: pass "
                                          "--tensorboard-dir DIR or --save DIR"):
        logging_config.check(1, None)
    logging_config.check(1, "s")


def test_pretrain_refuses_them_before_any_process_group(tmp_path, tiny_data, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = tiny_pretrain_args(tiny_data, str(tmp_path / "run"), 4, "--profile", "--profile-ranks", "2")
    with pytest.raises(ConfigError, match="--profile-ranks 2: this run has ranks 0..1"):
        pretrain.prepare(argv)
    assert not torch.distributed.is_initialized()
