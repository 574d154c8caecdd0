"""--async-save (checkpoint/async_save.py): the host snapshot is what torch.save would have written at the save step,
whatever training does afterwards; a run that saves in the background every 2 iterations has the losses of a run that
does not save, writes the files a sync save writes, and resumes exactly; a full disk during a background write is one
error line, `latest` unchanged, no partial directory, exit 1 before the end. Killing or preempting a job while a write
is in flight: tests/cluster/test_async_save_preemption.py."""

import io
import os
import pathlib
import time

import pytest
import torch
import torch.distributed as dist

from codegeex_train.checkpoint.async_save import AsyncCheckpointer, BackgroundWriter, snapshot
from codegeex_train.checkpoint.deepspeed_checkpoint import commit_save
from codegeex_train.checkpoint.files import META_KEY, read_latest
from tests.checkpoint.test_hostile_checkpoints import (  # noqa: F401 - fixtures: small_tmpfs needs trained
    assert_failed_save,
    full_disk_open,
    small_tmpfs,
    trained,
)
from tests.harness import (
    RankFailure,
    checkpoint_at,
    fails_with,
    metrics_records,
    run_distributed,
    run_pretrain,
    tiny_model_args,
    tiny_pretrain_args,
)


class LossScaler:  # a live non-tensor object of the state (DeepSpeed's loss scaler is one)
    def __init__(self, scale):
        self.scale = scale


def saved_bytes(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def test_snapshot_writes_what_torch_save_wrote_at_the_save_step():
    flat = torch.arange(12.0)  # ZeRO's flat buffers: parameters are views into one storage
    state = {"view": flat[2:5], "whole": flat, "param": torch.nn.Parameter(torch.ones(3)), "scaler": LossScaler(2.0),
             "bf16": torch.zeros(2, dtype=torch.bfloat16), "nested": [(1, "x", torch.tensor(3))]}
    expected = saved_bytes(state)
    snap = snapshot(state)
    flat += 1  # training goes on: the step changes weights, moments and the loss scale in place
    state["param"].data.mul_(3)
    state["scaler"].scale = 1024.0
    assert saved_bytes(state) != expected
    assert saved_bytes(snap.obj) == expected  # the same file, byte for byte: shared storage, offsets, types, values
    assert len(snap.storages) == 4  # one copy per storage, as torch.save writes one record per storage


def test_background_writer_stops_a_save_at_its_first_failure(tmp_path):
    written = []

    def write(obj, path):
        if path.endswith("b.pt"):
            return path, "No space left on device"
        torch.save(obj, path)
        written.append(path)
        return None

    writer = BackgroundWriter()
    pending = writer.begin(str(tmp_path), "iter_0000001")
    for name in ("a.pt", "b.pt", "c.pt"):
        writer.submit({"w": torch.ones(2)}, str(tmp_path / name), write)
    writer.seal()
    assert pending.done.wait(30)
    assert pending.failure == (str(tmp_path / "b.pt"), "No space left on device")
    assert written == [str(tmp_path / "a.pt")] and not (tmp_path / "c.pt").exists()  # nothing after the failure
    with pytest.raises(RuntimeError, match="still being written"):
        writer.begin(str(tmp_path), "iter_0000002")  # at most one in flight until it is committed (taken)
    assert writer.take() is pending
    failed_writer = BackgroundWriter()  # a rank that failed before any file (a directory it could not create)
    failed = failed_writer.begin(str(tmp_path), "iter_0000002")
    failed_writer.seal((str(tmp_path / "iter_0000002"), "Permission denied"))
    assert failed.done.wait(30) and failed.failure == (str(tmp_path / "iter_0000002"), "Permission denied")


SLOW_WRITE_S = 0.5  # rank 1's write: long enough for a commit that does not wait for it to move `latest` first


def commit_while_a_rank_writes(topology, save_dir: str, mode: str):
    """A rank's body: each rank writes its file of iter_0000001, rank 1 slowly, then commits as the trainer does:
    ``sync``, each rank calls commit_save after its own write; else in the background, committed at the end of the
    run (``end``: wait) or polled at each step boundary (``polled``). Returns (the tag committed, whether rank 1
    found `latest` already moved when its write began, the polls that returned None, the tag's files then)."""
    rank, tag = dist.get_rank(), "iter_0000001"
    tag_dir = os.path.join(save_dir, tag)
    latest_before_write = []

    def write(obj, path):
        if rank == 1:
            time.sleep(SLOW_WRITE_S)
            latest_before_write.append(os.path.exists(os.path.join(save_dir, "latest")))
        torch.save(obj, path)
        return None

    os.makedirs(tag_dir, exist_ok=True)
    state, path = {"w": torch.full((4,), float(rank))}, os.path.join(tag_dir, f"rank_{rank}.pt")
    polls = 0
    if mode == "sync":
        write(state, path)
        commit_save(save_dir, tag, None)
        committed = tag
    else:
        writer = BackgroundWriter()
        writer.begin(save_dir, tag)
        writer.submit(state, path, write)
        writer.seal()
        checkpointer = AsyncCheckpointer(writer)
        committed = checkpointer.commit(wait=mode == "end")
        while committed is None and mode == "polled" and polls < 1000:
            polls += 1
            time.sleep(0.005)
            committed = checkpointer.commit(wait=False)
    return committed, latest_before_write, polls, sorted(os.listdir(tag_dir))


@pytest.mark.parametrize("mode", ["sync", "end", "polled"])
def test_latest_moves_only_after_every_ranks_write(tmp_path, mode):
    """2 gloo ranks, rank 1's write slow: `latest` names the tag only once both ranks' files are written; a polled
    commit returns None on every rank alike until then, each poll one collective (the ranks stay in step). The
    cluster test test_async_save_preemption.py kills a job in that window."""
    results = run_distributed(commit_while_a_rank_writes, world_size=2, deadline_s=60, save_dir=str(tmp_path),
                              mode=mode)
    for rank, (committed, _, _, files) in enumerate(results):
        assert committed == "iter_0000001" and files == ["rank_0.pt", "rank_1.pt"], (rank, committed, files)
    assert results[1][1] == [False], "`latest` moved before rank 1's write"
    assert read_latest(str(tmp_path)) == "iter_0000001"
    if mode == "polled":  # rank 0, done first, went on polling as long as rank 1 was writing
        assert results[0][2] == results[1][2] > 0, [r[2] for r in results]


def same_structure(a, b, where="") -> list[str]:
    """Where two loaded checkpoint files differ: keys, types, tensors (dtype, shape, values), other leaves; our
    metadata's resolved_config (the run's flags, --async-save among them) and the training state's run_id (each run
    its own) are not compared."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
        return [] if same else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if list(a) != list(b):
            return [f"{where}: keys {list(a)} != {list(b)}"]
        return [d for k in a if k not in ("resolved_config", "run_id")
                for d in same_structure(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, (list, tuple)) and type(a) is type(b) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in same_structure(x, y, f"{where}[{i}]")]
    if type(a) is type(b) and hasattr(a, "__dict__") and not isinstance(a, type):  # e.g. DeepSpeed's loss scaler
        return same_structure(vars(a), vars(b), where)
    return [] if type(a) is type(b) and a == b else [f"{where}: {a!r} != {b!r}"]


def test_async_saves_change_no_loss_write_the_sync_files_and_resume_exactly(tmp_path, tiny_data):
    """DP 2 (ZeRO-2 partitions the optimizer). Async saves at 2, 4, 6 against a sync run that saves only after its
    last step; then a resume from the async iter_0000004."""
    def train(name, *extra, load=None):
        save = str(tmp_path / name) if load is None else load
        run_distributed(run_pretrain, world_size=2, deadline_s=300,
                        argv=tiny_pretrain_args(tiny_data, save, 6, *extra, *(["--load", load] if load else [])))
        return save

    background = train("async", "--async-save", "--save-interval", "2")
    plain = train("sync")  # no --save-interval: its one save is after the last step
    a, s = metrics_records(background), metrics_records(plain)
    assert sorted(a) == sorted(s) == list(range(1, 7))
    for it in a:
        for key in ("loss", "grad_norm", "lr"):
            assert a[it][key] == s[it][key], (it, key)  # bit for bit
    assert read_latest(background) == read_latest(plain) == "iter_0000006"
    assert sorted(p.name for p in pathlib.Path(background).iterdir() if p.name.startswith("iter_")) == [
        "iter_0000002", "iter_0000004", "iter_0000006"]
    files = sorted(p.name for p in (pathlib.Path(plain) / "iter_0000006").iterdir())
    assert files == sorted(p.name for p in (pathlib.Path(background) / "iter_0000006").iterdir())
    assert sum(name.endswith("optim_states.pt") for name in files) == 2, files  # both DP ranks' ZeRO partitions
    for name in files:
        if name.endswith(".pt"):
            x, y = (torch.load(pathlib.Path(run) / "iter_0000006" / name, map_location="cpu", weights_only=False)
                    for run in (background, plain))
            assert not same_structure(x, y), (name, same_structure(x, y))
            if META_KEY in x:
                assert x[META_KEY]["train_state"]["iteration"] == 6

    resumed = train("resumed", "--async-save", "--save-interval", "2",
                    load=checkpoint_at(background, tmp_path / "resumed", 4))
    r = metrics_records(resumed)
    assert sorted(r) == [5, 6]
    for it in r:
        assert r[it]["loss"] == a[it]["loss"] and r[it]["grad_norm"] == a[it]["grad_norm"], it


def pretrain_into_full_disk(topology, argv, inject):
    """A rank of pretrain.main; with ``inject`` its ZeRO file of iter_0000004 hits a full disk (the writer thread
    opens files through SafeCheckpointEngine._open, as a sync save does)."""
    from codegeex_train import pretrain
    from codegeex_train.checkpoint import deepspeed_checkpoint

    if inject:
        deepspeed_checkpoint.SafeCheckpointEngine._open = full_disk_open(
            lambda path: "/iter_0000004/" in path and path.endswith("optim_states.pt"))
    pretrain.main(argv)


@pytest.fixture
def full_disk(request, tmp_path):
    """A save directory on a tmpfs with room for one checkpoint and half another; where no tmpfs can be mounted, a
    full disk injected at the write of iter_0000004's ZeRO file."""
    try:
        mount = request.getfixturevalue("small_tmpfs")
    except pytest.skip.Exception:
        return str(tmp_path / "run"), True
    return str(mount / "run"), False


@pytest.mark.slow  # ~28 s with the tmpfs's sizing run; the writer's failure path is also the unit test above
def test_full_disk_during_a_background_write(full_disk, tiny_data, capfd):
    save, inject = full_disk
    argv = tiny_pretrain_args(tiny_data, save, 8, "--save-interval", "2", "--async-save")
    with pytest.raises(RankFailure) as failure:
        run_distributed(pretrain_into_full_disk, world_size=1, deadline_s=300, argv=argv, inject=inject)
    assert_failed_save(capfd, failure, save, world=1)  # one error line, latest unchanged, no partial directory
    # It stopped at a step boundary after the failed write (which iteration depends on when the writer is done),
    # before the end: never training on without checkpoints, never a save after the failed one.
    logged = metrics_records(save)
    assert 4 <= max(logged) < 8, sorted(logged)
    assert not os.path.exists(os.path.join(save, "iter_0000006"))



def test_async_save_without_save_is_one_error_line(capsys, tiny_data):
    fails_with(capsys, [*tiny_model_args(), "--data-path", tiny_data, "--async-save"],
               "--async-save writes --save's checkpoints in the background", "give --save DIR")
