"""Problems and samples files are read with a bound (before: a device grew a line until MemoryError): a regular file
only, at most MAX_PROBLEMS_BYTES / MAX_SAMPLES_BYTES decompressed; evaluate_humaneval.py says so in one line."""

from __future__ import annotations

import gzip
import zlib

import pytest

from codegeex_train.evaluation import ProblemsError, problems, read_problems, read_samples
from tests.harness import load_tool


def gzip_of_zeros(path, size: int) -> None:
    c = zlib.compressobj(9, zlib.DEFLATED, 31)
    with open(path, "wb") as f:
        for _ in range(size >> 20):
            f.write(c.compress(bytes(1 << 20)))
        f.write(c.flush())


def test_problems_and_samples_must_be_regular_files():
    with pytest.raises(ProblemsError, match="^/dev/null: a character device, not a regular file"):
        read_problems("/dev/null")
    with pytest.raises(ProblemsError, match="^--samples /dev/null: a character device, not a regular file"):
        read_samples("/dev/null")


def test_problems_and_samples_are_bounded_decompressed(tmp_path, monkeypatch):
    monkeypatch.setattr(problems, "MAX_PROBLEMS_BYTES", 1 << 20)
    monkeypatch.setattr(problems, "MAX_SAMPLES_BYTES", 1 << 20)
    gzip_of_zeros(tmp_path / "bomb.jsonl.gz", 2 << 20)  # one line of 2 MiB: a few KiB on disk
    with pytest.raises(ProblemsError, match="bomb.jsonl.gz: larger than 1 MiB decompressed, the bound on this file"):
        read_problems(tmp_path / "bomb.jsonl.gz")
    line = b'{"task_id": "HumanEval/0", "completion": "    return 1\\n"}\n'
    (tmp_path / "samples.jsonl.gz").write_bytes(gzip.compress(line * ((1 << 20) // len(line) + 1)))
    with pytest.raises(ProblemsError, match="^--samples .*samples.jsonl.gz: larger than 1 MiB decompressed"):
        read_samples(tmp_path / "samples.jsonl.gz")
    (tmp_path / "few.jsonl.gz").write_bytes(gzip.compress(line * 3))
    assert len(read_samples(tmp_path / "few.jsonl.gz")) == 3


@pytest.mark.parametrize("args, message", [
    (["--samples", "/dev/null"], "--samples /dev/null: a character device, not a regular file"),
    (["--canonical", "--problems", "/dev/null"], "/dev/null: a character device, not a regular file"),
])
def test_evaluate_tool_refuses_a_device_in_one_line(capsys, args, message):
    with pytest.raises(SystemExit) as e:
        load_tool("evaluate_humaneval").main(args)
    assert e.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err[-1].startswith("evaluate_humaneval.py: error: ") and message in err[-1], err
    assert "Traceback" not in "\n".join(err)
