"""The checkpoint manager's rules (checkpoint/manager.py), with the files' writer replaced by a recorder: which steps
save, that retention follows each commit on global rank 0 only, that a stop by signal writes the `preempted` marker
after `latest`, that ``for_run`` holds --save's lock for the manager's life and moves a run aside under --start-over;
and, on one gloo rank with a real background writer, --async-save's order at step boundaries. End to end (real
saves, sync and async, retention, preemption): test_async_save.py, test_retention.py, test_save_lock.py,
tests/cluster/test_async_save_preemption.py."""

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from codegeex_train.checkpoint import manager as manager_module
from codegeex_train.checkpoint.async_save import TEST_SLOW_WRITE_ENV
from codegeex_train.checkpoint.files import checkpoint_tag, read_latest, write_latest
from codegeex_train.checkpoint.manager import CheckpointManager
from codegeex_train.checkpoint.train_state import TrainState
from codegeex_train.config.arguments import TrainConfig
from tests.harness import run_distributed


@pytest.fixture
def recorded(monkeypatch):
    """The manager's writes, commits and retention, recorded in order (no engine, no process group)."""
    events = []

    def write(engine, save_dir, state, *args, background=None, **kwargs):
        events.append(("write", checkpoint_tag(state.iteration)))
        return checkpoint_tag(state.iteration), None

    def commit(save_dir, tag, failure):
        write_latest(save_dir, tag)
        events.append(("commit", tag))

    monkeypatch.setattr(manager_module, "write_checkpoint", write)
    monkeypatch.setattr(manager_module, "commit_save", commit)
    monkeypatch.setattr(manager_module, "apply_retention",
                        lambda save_dir, keep_last, keep_every, run_id, foreign: events.append(("retain", keep_last)))
    return events


def attached(manager: CheckpointManager, rank: int = 0) -> CheckpointManager:
    manager.attach(None, None, SimpleNamespace(rank=rank), None)
    return manager


def test_a_step_saves_on_schedule_and_at_the_last_iteration(tmp_path, recorded):
    manager = attached(CheckpointManager(str(tmp_path), save_interval=3))
    state, returned = TrainState(), []
    for iteration in range(1, 8):
        state.iteration = iteration
        returned.append(manager.step(state, last=iteration == 7))
    assert [manager.saves_at(i) for i in (3, 4, 6, 7)] == [True, False, True, False]
    assert returned == [None, None, checkpoint_tag(3), None, None, checkpoint_tag(6), checkpoint_tag(7)]
    assert [tag for kind, tag in recorded if kind == "write"] == [checkpoint_tag(i) for i in (3, 6, 7)]
    assert manager.finish() is None  # sync: every save committed itself

    nothing = attached(CheckpointManager())  # no --save: no step saves, the last neither
    assert not nothing.saves_at(3) and nothing.step(TrainState(iteration=3), last=True) is None
    assert nothing.last_good() == "none (no --save)"


@pytest.mark.parametrize("rank", [0, 1])
def test_retention_follows_each_commit_on_global_rank_0(tmp_path, recorded, rank):
    manager = attached(CheckpointManager(str(tmp_path), save_interval=1, keep_last=2), rank)
    for iteration in (1, 2):
        manager.step(TrainState(iteration=iteration))
    expected = [e for i in (1, 2) for e in (("write", checkpoint_tag(i)), ("commit", checkpoint_tag(i)))
                + ((("retain", 2),) if rank == 0 else ())]
    assert recorded == expected


@pytest.mark.parametrize("rank", [0, 1])
def test_a_stop_by_signal_writes_the_marker_after_latest(tmp_path, recorded, rank):
    (tmp_path / "preempted").write_text("iter_0000001")  # a stop before: the run going on removes it
    manager = attached(CheckpointManager(str(tmp_path), save_interval=10), rank)
    assert (tmp_path / "preempted").exists() == (rank != 0)
    tag = manager.step(TrainState(iteration=4), last=True, preempted=True)
    assert tag == checkpoint_tag(4) == read_latest(tmp_path)
    assert (tmp_path / "preempted").read_text() == (tag if rank == 0 else "iter_0000001")
    assert manager.last_good() == f"{tag} in {tmp_path} (relaunch with --load {tmp_path} to resume from it)"


LOCKED = ("import fcntl, os, sys\n"
          "fd = os.open(sys.argv[1], os.O_RDWR)\n"
          "try:\n"
          "    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
          "except OSError:\n"
          "    print('held')\n"
          "else:\n"
          "    print('free')\n")


def lock_state(save_dir) -> str:
    """Whether another process finds --save's lock held."""
    return subprocess.run([sys.executable, "-c", LOCKED, str(save_dir / ".lock")], capture_output=True, text=True,
                          check=True, timeout=60).stdout.strip()


def test_for_run_holds_the_lock_for_its_life_and_moves_a_run_aside(tmp_path):
    save = tmp_path / "run"
    (save / checkpoint_tag(2)).mkdir(parents=True)
    write_latest(save, checkpoint_tag(2))
    train = TrainConfig(save=str(save), start_over=True, save_interval=2)
    other_rank = CheckpointManager.for_run(train, rank=1)  # only global rank 0 locks and moves
    assert not (save / ".lock").exists() and (save / "latest").exists()
    manager = CheckpointManager.for_run(train, rank=0)
    assert sorted(os.listdir(save / "previous-runs" / "1")) == [checkpoint_tag(2), "latest"]
    assert not (save / "latest").exists() and lock_state(save) == "held"
    assert manager.saves_at(4) and other_rank.saves_at(4)
    del manager
    assert lock_state(save) == "free"  # the lock goes with the manager (and with the process, whatever ends it)


def async_steps(topology, save_dir: str):
    """One rank: --async-save's step boundaries over a real BackgroundWriter, each write slowed down (the files'
    writer replaced by one file per save). Returns what each step returned, the saves begun, and `latest` and the
    marker after each scenario."""
    from codegeex_train.checkpoint import manager as module

    begun = []

    def write(engine, directory, state, *args, background=None, **kwargs):
        tag = checkpoint_tag(state.iteration)
        os.makedirs(os.path.join(directory, tag), exist_ok=True)
        background.begin(directory, tag)
        background.submit({"w": torch.ones(2)}, os.path.join(directory, tag, "w.pt"), lambda obj, path: torch.save(
            obj, path))
        background.seal()
        begun.append(tag)
        return tag, None

    module.write_checkpoint = write
    out = {}
    for scenario, last_kwargs in (("preempted", {"preempted": True}), ("end", {})):
        directory = os.path.join(save_dir, scenario)
        manager = CheckpointManager(directory, save_interval=2, async_save=True,
                                    environ={TEST_SLOW_WRITE_ENV: "0.5"})
        manager.attach(None, None, topology, None)
        begun.clear()
        state, returned = TrainState(), []
        for iteration in (1, 2, 3):
            state.iteration = iteration
            returned.append(manager.step(state))
        writing = manager.writing
        state.iteration = 4
        returned.append(manager.step(state, last=True, **last_kwargs))
        marker = os.path.join(directory, "preempted")
        out[scenario] = (returned, list(begun), writing, read_latest(directory),
                         open(marker).read() if os.path.exists(marker) else None, manager.writing)
    return out


@pytest.mark.slow  # ~9 s: a spawned rank and two slowed writes per scenario
def test_async_steps_commit_at_boundaries_and_a_stop_completes_the_save_in_flight(tmp_path):
    (result,) = run_distributed(async_steps, world_size=1, deadline_s=120, save_dir=str(tmp_path))
    # Stopped by a signal at 4 while iteration 2's save is still being written: that save completes and becomes
    # `latest` and the marker; no second write is started in the kill window.
    returned, begun, writing, latest, marker, still_writing = result["preempted"]
    assert returned == [None, None, None, checkpoint_tag(2)] and begun == [checkpoint_tag(2)] and writing
    assert latest == marker == checkpoint_tag(2) and not still_writing
    # The end of training: the save in flight is committed, then the last iteration's is written and waited for.
    returned, begun, writing, latest, marker, still_writing = result["end"]
    assert returned == [None, None, None, checkpoint_tag(4)] and begun == [checkpoint_tag(2), checkpoint_tag(4)]
    assert latest == checkpoint_tag(4) and marker is None and not still_writing
