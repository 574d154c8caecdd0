"""A --save directory belongs to one run (issue 43, cases 1, 2, 5 and 12): a relaunch without --load resumes the run
it finds (a job killed with -9 and relaunched by the same command continues exactly, nothing of it removed); any
other start there is refused unless --start-over, which moves the old run aside whole; a save never writes over a
tag this run did not write; a continued run keeps its LR schedule or is refused (Megatron's two flags decide), and
the documented extension gives, at every step, the uninterrupted run's LR, loss and grad norm; the converter takes
the save lock and never writes into a run."""

import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from codegeex_train import pretrain
from codegeex_train.checkpoint import run_dir
from codegeex_train.checkpoint.files import checkpoint_tag, read_latest, save_model_checkpoint
from codegeex_train.checkpoint.resume import ResumeKind
from codegeex_train.config.model_config import ModelConfig
from tests.harness import (
    RankFailure,
    fails_with,
    load_tool,
    metrics_records,
    read_metrics,
    run_distributed,
    run_pretrain,
    tiny_pretrain_args,
    write_indexed_dataset,
)

CONFIG = ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2, max_position_embeddings=16, vocab_size=64)


def tags(directory) -> set[int]:
    return {int(name[5:]) for name in os.listdir(directory) if name.startswith("iter_")}


# --- A relaunch without --load resumes the run; a job killed with -9 loses nothing ------------------------------

def killed_at(topology, argv, iteration):
    """A rank's body: the run, killed with SIGKILL (no handler, no save) as its ``iteration``th step begins."""
    from codegeex_train.training import trainer

    real, steps = trainer.train_step, [0]

    def step(*args, **kwargs):
        steps[0] += 1
        if steps[0] == iteration:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)

    trainer.train_step = step
    pretrain.main(argv)


@pytest.mark.slow
def test_a_job_killed_and_relaunched_by_the_same_command_resumes_exactly(tmp_path, tiny_data):
    # The SLURM requeue: `srun python -m codegeex_train.pretrain ... --save RUN` (no --load) again, with
    # retention on. Before, the relaunch started at iteration 1 and retention then removed the run's checkpoints.
    def argv(save):
        return tiny_pretrain_args(tiny_data, save, 6, "--save-interval", "2", "--keep-last-n-checkpoints", "1")

    full, killed = str(tmp_path / "full"), str(tmp_path / "killed")
    run_distributed(run_pretrain, world_size=2, deadline_s=600, argv=argv(full))
    with pytest.raises(RankFailure, match=f"exited with code {-signal.SIGKILL}"):
        run_distributed(killed_at, world_size=2, deadline_s=600, argv=argv(killed), iteration=5)
    # iter_0000004 (under --async-save, CODEGEEX_TEST_ASYNC_SAVE=1, the save of 4 may not be committed by then: 2)
    saved = int(read_latest(killed).removeprefix("iter_"))
    assert saved in (2, 4) and tags(killed) >= {saved}
    before = len(read_metrics(killed))
    run_distributed(run_pretrain, world_size=2, deadline_s=600, argv=argv(killed))  # the same command
    relaunched = [r for r in read_metrics(killed)[before:] if r.get("split", "train") == "train"]
    assert [r["iteration"] for r in relaunched] == list(range(saved + 1, 7))  # resumed, not from scratch
    a, b = metrics_records(full), metrics_records(killed)
    for it in range(1, 7):
        for key in ("loss", "lr", "grad_norm"):
            assert b[it][key] == pytest.approx(a[it][key], rel=1e-6, abs=1e-9), (it, key)
        assert b[it]["consumed_samples"] == 8 * it
    assert read_latest(killed) == checkpoint_tag(6) and tags(killed) == {6}


@pytest.fixture(scope="module")
def run(tiny_data, tmp_path_factory):
    """A finished 2-iteration run (one rank) saving at every iteration, its LR decaying to 2e-4: its --save
    directory."""
    save = tmp_path_factory.mktemp("run_dir") / "run"
    run_distributed(run_pretrain, world_size=1, deadline_s=300,
                    argv=tiny_pretrain_args(tiny_data, str(save), 2, "--save-interval", "1", "--min-lr", "2e-4"))
    return save


# The fixture run's LR schedule, for a resume of it to more iterations.
SAME_SCHEDULE = ("--lr-decay-iters", "2", "--min-lr", "2e-4")


@pytest.fixture
def copy(run, tmp_path, monkeypatch):
    """``copy(name)``: a copy of the run to work on; pretrain sees one rank, run from ``tmp_path``."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.chdir(tmp_path)
    return lambda name="run": shutil.copytree(run, tmp_path / name)


def test_save_holding_a_run_is_resumed_without_load(copy, tiny_data, capsys):
    save = copy()
    prepared = pretrain.prepare(tiny_pretrain_args(tiny_data, str(save), 4, *SAME_SCHEDULE))
    resume = prepared.resume
    assert (resume.load_dir, resume.tag, resume.kind) == (str(save), checkpoint_tag(2), ResumeKind.TRAINING)
    assert resume.note.startswith(f"--save {save} holds a run (iter_0000002): resuming it")
    # The dry run of the run's own config.yaml said "start from scratch" before.
    # (--save: the file names the directory the fixture's run saved to; this test works on a copy of it)
    assert pretrain.main(["--config", str(save / "config.yaml"), "--save", str(save), "--train-iters", "4",
                          *SAME_SCHEDULE, "--dry-run"]) is None
    report = capsys.readouterr().out
    assert f"start --load {save} (iter_0000002, training): --save {save} holds a run" in report


def test_another_runs_load_into_a_save_holding_a_run_is_refused(copy, tiny_data, capsys):
    save, other = copy(), copy("other")
    other_tag = other / checkpoint_tag(2) / "mp_rank_00_model_states.pt"
    import torch
    state = torch.load(other_tag, weights_only=False)
    state["codegeex_train"]["train_state"]["run_id"] = "another-run"
    torch.save(state, other_tag)
    argv = tiny_pretrain_args(tiny_data, str(save), 4, *SAME_SCHEDULE, "--load", str(other))
    fails_with(capsys, argv, f"--save {save} holds a run ('latest' names iter_0000002)",
               f"--load {other} is another run's checkpoint", "drop --load", "--start-over", "another --save")
    # --load of the run that --save continues (its id recorded in both): a relaunch, resumed from --save.
    resume = pretrain.prepare(tiny_pretrain_args(tiny_data, str(save), 4, *SAME_SCHEDULE, "--load",
                                                 str(copy("origin")))).resume
    assert resume.load_dir == str(save) and "which that run started from" in resume.note


def test_start_over_refusals(copy, tiny_data, capsys):
    save = copy()
    fails_with(capsys, tiny_pretrain_args(tiny_data, str(save), 2, "--start-over", "--load", str(save)),
               "--start-over with --load", "equal to --save")
    argv = [a for a in tiny_pretrain_args(tiny_data, "x", 2, "--start-over") if a not in ("--save", "x", "--async-save")]
    fails_with(capsys, argv, "--start-over", "give --save DIR")


@pytest.mark.slow
def test_start_over_moves_the_old_run_aside_whole(copy, tiny_data):
    save = copy()
    before = {name: (save / checkpoint_tag(2) / name).read_bytes() for name in os.listdir(save / checkpoint_tag(2))}
    old_metrics = (save / "metrics.jsonl").read_text()
    run_distributed(run_pretrain, world_size=1, deadline_s=300,
                    argv=tiny_pretrain_args(tiny_data, str(save), 1, "--start-over", "--seed", "8"))
    archive = save / "previous-runs" / "1"
    assert read_latest(archive) == checkpoint_tag(2) and tags(archive) == {1, 2}
    assert {n: (archive / checkpoint_tag(2) / n).read_bytes() for n in before} == before  # untouched, readable
    assert (archive / "metrics.jsonl").read_text() == old_metrics and (archive / "config.yaml").is_file()
    assert read_latest(save) == checkpoint_tag(1) and tags(save) == {1}
    assert [r["iteration"] for r in read_metrics(save) if r.get("split") == "train"] == [1]
    # The archive is a run directory of its own: --load resumes it.
    resume = pretrain.prepare(tiny_pretrain_args(tiny_data, str(save / "new"), 3, *SAME_SCHEDULE,
                                                 "--load", str(archive))).resume
    assert (resume.load_dir, resume.tag) == (str(archive), checkpoint_tag(2))


# --- Moving a run aside: crash-safe at every step; a save never writes over another run's tag -----------------

def fake_run(directory, iterations=(1, 2, 3), run_id="r1") -> None:
    for i in iterations:
        save_model_checkpoint(directory, [{}], CONFIG, 1, tag=checkpoint_tag(i), iteration=i)
        path = directory / checkpoint_tag(i) / "mp_rank_00_model_states.pt"
        import torch
        state = torch.load(path, weights_only=True)
        state["codegeex_train"]["train_state"] = {"iteration": i, "consumed_train_samples": i, "run_id": run_id}
        torch.save(state, path)
    (directory / "metrics.jsonl").write_text("{}\n")


@pytest.mark.parametrize("crash_after", range(6))
def test_archiving_cut_short_anywhere_loses_nothing(tmp_path, monkeypatch, crash_after):
    fake_run(tmp_path)
    everything = {checkpoint_tag(i) for i in (1, 2, 3)} | {"latest", "metrics.jsonl"}
    rename, done = os.rename, []

    def dying_rename(a, b):
        if len(done) == crash_after:
            raise KeyboardInterrupt  # the process ends here
        done.append(a)
        rename(a, b)

    monkeypatch.setattr(run_dir.os, "rename", dying_rename)
    try:
        run_dir.archive_run(tmp_path)
    except KeyboardInterrupt:
        pass
    monkeypatch.undo()
    archive = tmp_path / "previous-runs" / "1"
    moved = set(os.listdir(archive)) if archive.exists() else set()
    assert moved | (set(os.listdir(tmp_path)) - {"previous-runs"}) == everything and not moved & set(
        os.listdir(tmp_path))
    # A `latest` left on top names a tag on top: a relaunch resumes the run. (Cut between the last two renames, the
    # archive's `latest` names the tag still on top: nothing lost, and the first save that would write over it moves
    # it aside.)
    if (tmp_path / "latest").exists():
        assert (tmp_path / read_latest(tmp_path)).is_dir()
    if (archive / "latest").exists():
        assert (archive / read_latest(archive)).is_dir() or (tmp_path / read_latest(archive)).is_dir()


def test_a_save_moves_aside_a_tag_it_did_not_write(tmp_path):
    fake_run(tmp_path, (1, 2), run_id="mine")
    fake_run(tmp_path, (3,), run_id="another-run")
    (tmp_path / checkpoint_tag(2) / "notes.txt").write_text("a user's")
    for tag in (checkpoint_tag(2), checkpoint_tag(3)):
        run_dir.clear_tag_for(tmp_path, tag, "mine")
    assert tags(tmp_path) == {1}
    assert (tmp_path / "previous-runs" / "1" / checkpoint_tag(2) / "notes.txt").read_text() == "a user's"
    assert tags(tmp_path / "previous-runs" / "2") == {3}
    fake_run(tmp_path, (4,), run_id="mine")
    run_dir.clear_tag_for(tmp_path, checkpoint_tag(4), "mine")  # its own (an earlier partial write): written over
    assert tags(tmp_path) == {1, 4}


# --- Continuing a run keeps its LR schedule, or is refused -------------------------------------------------------

@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    """27 training documents of 40 tokens (1080 tokens): 4 iterations of 8 x 32-token samples are 1 epoch, 8 are 2,
    so an extended run's data order must not depend on its length."""
    rng = np.random.default_rng(5)
    prefix = str(tmp_path_factory.mktemp("small") / "small")
    write_indexed_dataset(prefix, [rng.integers(1, 900, 40) for _ in range(30)])
    return prefix


SCHEDULE = ("--min-lr", "2e-4", "--split", "90,10,0")


def schedule_argv(data, save, iters, *extra):
    return tiny_pretrain_args(data, save, iters, "--save-interval", "2", *SCHEDULE, *extra)


@pytest.mark.slow
def test_the_documented_extension_equals_one_uninterrupted_run(tmp_path, small_data, capsys, monkeypatch):
    whole, extended = str(tmp_path / "whole"), str(tmp_path / "extended")
    run_distributed(run_pretrain, world_size=2, deadline_s=600,
                    argv=schedule_argv(small_data, whole, 8, "--lr-decay-iters", "4"))
    run_distributed(run_pretrain, world_size=2, deadline_s=600, argv=schedule_argv(small_data, extended, 4))
    # Raising --train-iters alone would decay over 8 iterations from step 5: refused, naming the fix.
    monkeypatch.setenv("WORLD_SIZE", "2")
    fails_with(capsys, schedule_argv(small_data, extended, 8),
               "decay_iters 4 in the checkpoint, 8 by these flags", "--lr-decay-iters 4",
               "--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler")
    monkeypatch.undo()
    run_distributed(run_pretrain, world_size=2, deadline_s=600,
                    argv=schedule_argv(small_data, extended, 8, "--lr-decay-iters", "4"))  # the documented command
    a, b = metrics_records(whole), metrics_records(extended)
    assert sorted(b) == list(range(1, 9))
    for it in range(1, 9):
        for key in ("loss", "lr", "grad_norm"):
            assert b[it][key] == pytest.approx(a[it][key], rel=1e-6, abs=1e-9), (it, key)
    assert b[8]["lr"] == pytest.approx(2e-4)  # decayed at 4, then the minimum


@pytest.mark.parametrize("change,fragment", [
    (("--lr", "1e-3"), "max_lr 0.002 in the checkpoint, 0.001 by these flags (--lr)"),
    (("--min-lr", "0"), "min_lr 0.0002 in the checkpoint, 0.0 by these flags (--min-lr)"),
    (("--lr-warmup-iters", "1"), "warmup_iters 2 in the checkpoint, 1 by these flags"),
    (("--lr-decay-style", "linear"), "style cosine in the checkpoint, linear by these flags (--lr-decay-style)"),
    (("--global-batch-size", "16"), "global_batch_size 8 in the checkpoint, 16 by these flags (--global-batch-size)"),
])
def test_a_changed_schedule_is_refused_unless_a_flag_decides(copy, tiny_data, capsys, monkeypatch, change, fragment):
    save = copy()
    argv = tiny_pretrain_args(tiny_data, str(save), 4, *SAME_SCHEDULE, *change)
    fails_with(capsys, argv, f"resuming {save} (iter_0000002): its LR schedule differs", fragment,
               "--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler")
    monkeypatch.undo()
    monkeypatch.setenv("WORLD_SIZE", "1")
    flags = pretrain.prepare([*argv, "--override-opt_param-scheduler"]).args.optim
    assert (flags.lr, flags.min_lr) == ((1e-3 if "--lr" in change else 2e-3),
                                        (0.0 if change[0] == "--min-lr" else 2e-4))
    prepared = pretrain.prepare([*argv, "--use-checkpoint-opt_param-scheduler"])
    o = prepared.args.optim  # the checkpoint's schedule (the global batch stays the flags')
    assert (o.lr, o.min_lr, o.lr_warmup_iters, o.lr_decay_iters, o.lr_decay_style) == (2e-3, 2e-4, 2, 2, "cosine")
    assert "the LR schedule is the checkpoint's" in prepared.resume.note


def test_both_schedule_flags_are_refused(tiny_data, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    fails_with(capsys, tiny_pretrain_args(tiny_data, "x", 2, "--override-opt_param-scheduler",
                                          "--use-checkpoint-opt_param-scheduler"), "are exclusive")


# --- The converter: the save lock, and never into a run -----------------------------------------------------------

def test_converter_refuses_a_save_holding_a_run(copy, capsys):
    save = copy()
    weights = copy("weights")
    convert = load_tool("convert_checkpoint")
    with pytest.raises(SystemExit) as e:
        convert.main(["--load", str(weights), "--save", str(save)])
    assert "error:" in str(e.value) and f"--save {save} holds a run ('latest' names iter_0000002)" in str(e.value)
    assert read_latest(save) == checkpoint_tag(2) and tags(save) == {1, 2}
    with pytest.raises(SystemExit) as e:
        convert.main(["--load", str(weights), "--to-universal", str(save)])
    assert f"--to-universal {save} holds a run" in str(e.value)


def test_converter_takes_the_save_lock(copy, tmp_path):
    weights, out = copy("weights"), tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\n"
                               "from codegeex_train.checkpoint.save_lock import hold_save_dir\n"
                               f"lock = hold_save_dir({str(out)!r}); print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"  # a live run holds --save
        with pytest.raises(SystemExit) as e:
            load_tool("convert_checkpoint").main(["--load", str(weights), "--save", str(out)])
        assert f"--save {out} is in use by another run" in str(e.value)
        assert not (out / "latest").exists()
    finally:
        holder.kill()
        holder.wait()
    time.sleep(0.1)
    load_tool("convert_checkpoint").main(["--load", str(weights), "--save", str(out)])  # free now: converted
    assert read_latest(out) == checkpoint_tag(2)


def test_console_lines_hold_no_credential(copy, tiny_data, capsys):
    # The script tees the console into OUTPUT_DIR/logs: a line echoing a path (the dry run's report, the resume
    # note) shows the credential in it redacted.
    token = "hf_" + "AbCdEfGhIjKlMnOpQrStUvWxYz0123456789"
    save = copy(f"run-{token}")
    assert pretrain.main(tiny_pretrain_args(tiny_data, str(save), 4, *SAME_SCHEDULE, "--dry-run")) is None
    out, err = capsys.readouterr()
    assert token not in out + err and "run-<redacted> holds a run (iter_0000002): resuming it" in out
