"""Retention (--keep-last-n-checkpoints, --keep-every-n-iterations) on tag directories written as a save writes them
(model files with our metadata and the run's id, then `latest`), no process group: which tags go, over a 20-save run,
against the rule written out independently here; a partial tag neither counted nor removed; nothing that is not this
run's own (another run's tag, a copy under another name, a user's file inside, a user's hidden directory) is ever
removed; a reader's lock keeps its tag and every later one; removal renames first, so a tag cut short mid-removal
never looks like a checkpoint. The end-to-end run (a real 20-save training run) is in test_save_lock.py, after the
lock it shares a launch with."""

import os
import shutil

import logging

import pytest
import torch

from codegeex_train.checkpoint import retention
from codegeex_train.checkpoint.files import META_KEY, checkpoint_tag, save_model_checkpoint, write_latest
from codegeex_train.checkpoint.retention import apply_retention, reading_checkpoint, tag_is_complete, tags_to_remove
from codegeex_train.config.arguments import ConfigError, TrainConfig
from codegeex_train.config.model_config import ModelConfig

CONFIG = ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2, max_position_embeddings=16, vocab_size=64)


RUN = "3f1c0e4d9a7b4c2e8d6f5a4b3c2d1e0f"  # this run's id, as TrainState.run_id records it


def save(save_dir, iteration: int, run_id: str = RUN, tag: str | None = None) -> None:
    """A committed save at ``iteration`` by run ``run_id``: its model file (TP 1) holding the training state a run
    records, then `latest` (naming ``tag``, default the iteration's)."""
    tag = tag or checkpoint_tag(iteration)
    save_model_checkpoint(save_dir, [{}], CONFIG, 1, tag=tag, iteration=iteration)
    path = os.path.join(save_dir, tag, "mp_rank_00_model_states.pt")
    state = torch.load(path, weights_only=True)
    state[META_KEY]["train_state"] = {"iteration": iteration, "consumed_train_samples": 8 * iteration,
                                      "run_id": run_id}
    torch.save(state, path)


def tags(save_dir) -> set[int]:
    return {int(name[5:]) for name in os.listdir(save_dir) if name.startswith("iter_")}


def expected(saved: int, keep_last: int, keep_every: int | None, partial=()) -> set[int]:
    """The rule: the keep_last newest complete saves, every multiple of keep_every, and partial tags untouched."""
    complete = [i for i in range(1, saved + 1) if i not in partial]
    return set(complete[-keep_last:]) | {i for i in complete if keep_every and i % keep_every == 0} | set(partial)


def test_a_20_save_run_keeps_the_last_n_and_the_permanent_ones(tmp_path):
    partial = 4  # a save at 4 died before its model file (and `latest`); the relaunch went on past it
    for i in range(1, 21):
        if i == partial:
            (tmp_path / checkpoint_tag(i)).mkdir()
            (tmp_path / checkpoint_tag(i) / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"")
        else:
            save(tmp_path, i)
        apply_retention(str(tmp_path), 3, 5, run_id=RUN)
        assert tags(tmp_path) == expected(i, 3, 5, partial=[partial] if i >= partial else []), i
        assert (tmp_path / "latest").read_text() == checkpoint_tag(i if i != partial else i - 1)
    assert tags(tmp_path) == {4, 5, 10, 15, 18, 19, 20}
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".")]  # nothing half-removed left


@pytest.mark.parametrize("keep_last,keep_every", [(1, None), (2, 3), (5, 1)])
def test_the_selection_rule(keep_last, keep_every):
    names = [checkpoint_tag(i) for i in range(1, 13)]
    incomplete = {checkpoint_tag(11), checkpoint_tag(2)}
    removed = tags_to_remove(names, names[-1], keep_last, keep_every, lambda tag: tag not in incomplete)
    kept = set(range(1, 13)) - {int(tag[5:]) for tag in removed}
    assert kept == expected(12, keep_last, keep_every, partial=[2, 11])
    assert names[-1] not in removed and removed == sorted(removed)


def test_latest_is_never_removed_even_when_older_than_the_newest(tmp_path):
    for i in (1, 2, 3, 4):
        save(tmp_path, i)
    write_latest(tmp_path, checkpoint_tag(2))  # a relaunch resumed from 2 and has not saved yet: 3 and 4 are ahead
    assert apply_retention(str(tmp_path), 1, run_id=RUN) == [checkpoint_tag(1)]
    assert tags(tmp_path) == {2, 3, 4}


def test_a_reader_keeps_its_tag_and_every_later_one(tmp_path):
    for i in (1, 2, 3):
        save(tmp_path, i)
    with reading_checkpoint(tmp_path) as held:  # a conversion of `latest`, iter_0000003, while training goes on
        assert held == checkpoint_tag(3)
        removed = []
        for i in (4, 5, 6):
            save(tmp_path, i)
            removed.append(apply_retention(str(tmp_path), 1, run_id=RUN))
        assert removed == [[checkpoint_tag(1), checkpoint_tag(2)], [], []]
        assert tags(tmp_path) == {3, 4, 5, 6}  # 3 is read; 4 and 5: a reader reads `latest` more than once
    assert apply_retention(str(tmp_path), 1, run_id=RUN) == [checkpoint_tag(i) for i in (3, 4, 5)]
    assert tags(tmp_path) == {6}


def test_a_reader_of_a_tag_removed_meanwhile_holds_the_next_latest(tmp_path, monkeypatch):
    for i in (1, 2):
        save(tmp_path, i)
    read_latest = retention.read_latest
    calls = []

    def stale_then_fresh(directory):  # the first read returns 1, which a retention removes before it is locked
        calls.append(directory)
        if len(calls) == 1:
            shutil.rmtree(tmp_path / checkpoint_tag(1))
            return checkpoint_tag(1)
        return read_latest(directory)

    monkeypatch.setattr(retention, "read_latest", stale_then_fresh)
    with reading_checkpoint(tmp_path) as held:
        assert held == checkpoint_tag(2) and len(calls) == 2


def test_removal_renames_first_and_the_next_retention_finishes_it(tmp_path, monkeypatch):
    for i in (1, 2):
        save(tmp_path, i)
    monkeypatch.setattr(retention.shutil, "rmtree", lambda *a, **k: None)  # the process dies mid-removal
    assert apply_retention(str(tmp_path), 1, run_id=RUN) == [checkpoint_tag(1)]
    assert tags(tmp_path) == {2} and (tmp_path / f".{checkpoint_tag(1)}.deleting-{RUN}").is_dir()
    monkeypatch.undo()
    save(tmp_path, 3)
    apply_retention(str(tmp_path), 2, run_id=RUN)
    assert tags(tmp_path) == {2, 3} and not (tmp_path / f".{checkpoint_tag(1)}.deleting-{RUN}").exists()


def test_only_this_runs_own_tags_are_removed(tmp_path, caplog):
    # Case 12 of issue 43: retention used to remove any complete tag, and any `.TAG.deleting` directory.
    save(tmp_path, 1)
    save(tmp_path, 2, run_id="another-run")  # a tag another run wrote (copied in, or a run started over here)
    save(tmp_path, 3)
    (tmp_path / checkpoint_tag(3) / "notes.txt").write_text("mine")  # a user's file inside this run's own tag
    shutil.copytree(tmp_path / checkpoint_tag(1), tmp_path / checkpoint_tag(4))  # a copy under another name
    save(tmp_path, 5)
    users = tmp_path / f".{checkpoint_tag(5)}.deleting"  # a user's hidden directory of a retention-like name
    users.mkdir()
    (users / "keep.txt").write_text("mine too")
    save(tmp_path, 6)
    with caplog.at_level(logging.INFO, logger=retention.__name__):
        removed = apply_retention(str(tmp_path), 1, run_id=RUN)
    assert removed == [checkpoint_tag(1), checkpoint_tag(5)]
    assert tags(tmp_path) == {2, 3, 4, 6}
    assert (tmp_path / checkpoint_tag(3) / "notes.txt").read_text() == "mine"
    assert (users / "keep.txt").read_text() == "mine too"
    said = [r.getMessage() for r in caplog.records if "not written by this run" in r.getMessage()]
    assert len(said) == 1 and all(checkpoint_tag(i) in said[0] for i in (2, 3, 4))
    assert "removed iter_0000001, iter_0000005" in caplog.text  # and what it removed, in one line


def test_tags_of_another_run_do_not_count_among_the_kept(tmp_path):
    for i in (1, 2):
        save(tmp_path, i)
    save(tmp_path, 3, run_id="another-run")
    save(tmp_path, 4)
    assert apply_retention(str(tmp_path), 2, run_id=RUN) == [checkpoint_tag(1)]  # 4 (latest) and 2 are the 2 newest
    assert tags(tmp_path) == {2, 3, 4}


def test_completeness_follows_the_recorded_layout(tmp_path):
    save_model_checkpoint(tmp_path, [{}, {}], CONFIG, 2, tag="iter_0000001", iteration=1)  # TP 2: two model files
    tag_dir = tmp_path / "iter_0000001"
    assert tag_is_complete(tag_dir)
    os.remove(tag_dir / "mp_rank_01_model_states.pt")
    assert not tag_is_complete(tag_dir)
    (tag_dir / "mp_rank_00_model_states.pt").write_bytes(b"truncated")
    assert not tag_is_complete(tag_dir)


@pytest.mark.parametrize("fields,message", [
    (dict(keep_last_n_checkpoints=2), "--keep-last-n-checkpoints 2 without --save"),
    (dict(async_save=True), "--async-save writes --save's checkpoints in the background, and there is no --save"),
    (dict(save="d", keep_every_n_iterations=10), "--keep-every-n-iterations 10 goes with --keep-last-n-checkpoints"),
    (dict(save="d", save_interval=4, keep_last_n_checkpoints=2, keep_every_n_iterations=10),
     "--keep-every-n-iterations 10 is not a multiple of --save-interval 4: a save lands on one of its multiples only "
     "every 20 iterations"),
])
def test_flag_combinations_refused(fields, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**fields).check_retention()
    TrainConfig(save="d", save_interval=5, keep_last_n_checkpoints=2, keep_every_n_iterations=10).check_retention()
