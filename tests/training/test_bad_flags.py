"""A flag out of its range, and a --save that cannot be written, fail with one ``error:`` line (exit 2) before any
process group. Before, most of these started training: silently (--clip-grad -1, --lr-warmup-iters -5), or until a
traceback from DeepSpeed, torch, numpy or the DataLoader (--global-batch-size -4, --adam-beta1 2, --lr nan, --seed -1,
--num-workers -1, a bad --split), a ZeroDivisionError after the first step (--log-interval 0), or an OSError at the
first write into --save. Every flag's range: tests/config/test_flag_ranges.py."""

import os
import subprocess
from pathlib import Path

import pytest

from tests.harness import fails_with, tiny_model_args


@pytest.fixture(autouse=True)
def in_an_empty_directory(tmp_path, monkeypatch):
    """Each refusal runs in an empty working directory and must leave it empty (tests/training/test_bad_input.py)."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    yield
    assert list(cwd.iterdir()) == []



@pytest.fixture
def base(tiny_data):
    """A command that trains (a few steps of the tiny model on the tiny corpus) but for the flag under test."""
    return [*tiny_model_args(), "--data-path", tiny_data, "--train-iters", "2", "--micro-batch-size", "2",
            "--num-workers", "0", "--no-progress-bar"]


OUT_OF_RANGE = [
    ("--global-batch-size", "-4", "--global-batch-size -4 must be >= 1"),
    ("--lr", "-1", "--lr -1.0 must be >= 0"),
    ("--adam-beta1", "2", "--adam-beta1 2.0 must be in [0, 1)"),
    ("--seed", "-1", "--seed -1 must be in [0, 4294967295]"),
    ("--num-workers", "-1", "--num-workers -1 must be >= 0"),
    ("--log-interval", "0", "--log-interval 0 must be >= 1"),
    ("--lr-warmup-iters", "-5", "--lr-warmup-iters -5 must be >= 0"),
    ("--clip-grad", "-1", "--clip-grad -1.0 must be >= 0"),
    ("--lr", "nan", "--lr nan must be a finite number >= 0"),
    ("--adam-eps", "inf", "--adam-eps inf must be a finite number > 0"),
    ("--hidden-dropout", "1", "--hidden-dropout 1.0 must be in [0, 1)"),
    ("--split", "0,0,0", "--split '0,0,0' must be 1 to 3 non-negative numbers with a positive sum"),
    ("--split", "a,b", "--split 'a,b' must be 1 to 3 non-negative numbers"),
    ("--split", "1,,2", "--split '1,,2' must be"),
]


@pytest.mark.parametrize("flag,value,message", OUT_OF_RANGE, ids=[f"{f}={v}" for f, v, _ in OUT_OF_RANGE])
def test_a_value_out_of_range(capsys, base, flag, value, message):
    fails_with(capsys, base + [f"{flag}={value}"], message)


def test_several_values_out_of_range_are_one_line(capsys, base):
    fails_with(capsys, base + ["--lr=-1", "--seed=-1"],
               "--seed -1 must be in [0, 4294967295] (default 1234); --lr -1.0 must be >= 0 (default 0.0003)")


def test_save_that_is_a_file(capsys, base, tmp_path):
    (tmp_path / "file").write_text("x")
    fails_with(capsys, base + ["--save", str(tmp_path / "file")], f"--save {tmp_path / 'file'} is not a directory",
               "give a directory")
    fails_with(capsys, base + ["--save", str(tmp_path / "file" / "ckpt")], f"is under {tmp_path / 'file'}, which is "
               "not a directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cwd", "file"]


def test_save_under_a_place_nobody_writes(capsys, base):
    # Root ignores permission bits; /proc refuses even root a new directory.
    fails_with(capsys, base + ["--save", "/proc/codegeex-ckpt/run"], "--save /proc/codegeex-ckpt/run: cannot write in "
               "/proc, its nearest existing parent", "choose a directory")


def read_only_directory(path: Path) -> bool:
    """Make ``path`` unwritable for this user: permission bits, or for root (who ignores them) the immutable
    attribute; False where neither holds (e.g. chattr unsupported by the file system)."""
    path.chmod(0o555)
    if not os.access(path, os.W_OK):
        return True
    return subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0


def test_save_in_a_read_only_directory(capsys, base, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    if not read_only_directory(ro):
        pytest.skip("cannot make a directory read-only here (root, and no chattr +i on this file system)")
    try:
        fails_with(capsys, base + ["--save", str(ro)], f"--save {ro}: cannot write in it", "make it writable")
        fails_with(capsys, base + ["--save", str(ro / "a" / "b")], f"cannot write in {ro}, its nearest existing parent")
    finally:
        subprocess.run(["chattr", "-i", str(ro)], capture_output=True)
        ro.chmod(0o755)
    assert list(ro.iterdir()) == []


def test_a_save_to_create_is_checked_and_not_created(capsys, base, tmp_path):
    """A writable --save that does not exist yet passes the check and is not made by it: a run refused after it
    (here by the data check) leaves nothing behind."""
    fails_with(capsys, base + ["--save", str(tmp_path / "new" / "ckpt"), "--data-path", str(tmp_path / "nope")],
               "nope.idx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cwd"]
