"""Files the user names are read with a bound (bounded_read.py): a regular file only (a device, a FIFO, a
directory refused before a byte is read, a FIFO without waiting for a writer), never more than the bound held
(gzip's decompressed bytes counted), each refusal one message naming the file and the bound; and its users: the
tokenizer files, MBPP's problems."""

from __future__ import annotations

import gzip
import json
import os
import zlib

import pytest

from codegeex_train.preprocessing import decontaminate
from codegeex_train.tokenization import tokenizer
from codegeex_train.bounded_read import (
    FileReadError,
    check_file,
    json_objects,
    read_bytes,
    read_jsonl,
    read_lines,
    read_text,
)
from codegeex_train.preprocessing.decontaminate import BenchmarkError, read_mbpp
from codegeex_train.tokenization.tokenizer import TokenizerError, build_tokenizer
from tests.harness import deadline




def gzip_of_zeros(path, size: int) -> None:
    """A gzip file of ``size`` zero bytes, written a MiB at a time (a bomb: a few KiB on disk)."""
    c = zlib.compressobj(9, zlib.DEFLATED, 31)
    with open(path, "wb") as f:
        for _ in range(size >> 20):
            f.write(c.compress(bytes(1 << 20)))
        f.write(c.compress(bytes(size & ((1 << 20) - 1))) + c.flush())


def test_a_regular_file_within_its_bound_reads_whole(tmp_path):
    (tmp_path / "a.txt").write_bytes("naïve\n".encode() * 4)
    assert read_text(tmp_path / "a.txt", 28, "--flag") == "naïve\n" * 4
    (tmp_path / "a.gz").write_bytes(gzip.compress(b"x\ny\n"))
    assert read_bytes(tmp_path / "a.gz", 4, gunzip=True) == b"x\ny\n"
    assert read_bytes(tmp_path / "a.gz", 100) == (tmp_path / "a.gz").read_bytes()  # gunzip off: the bytes as stored
    assert list(read_lines(tmp_path / "a.gz", 4)) == [(1, b"x\n"), (2, b"y\n")]
    assert check_file(tmp_path / "a.txt", 28) == 28


def test_over_the_bound_is_refused_naming_the_file_and_the_bound(tmp_path):
    path = tmp_path / "big.txt"
    path.write_bytes(b"x" * 1025)
    for read in (read_bytes, read_text, check_file, lambda p, n, w: list(read_lines(p, n, w))):
        with pytest.raises(FileReadError, match=f"^--prompt-file {path}: larger than 1 KiB, the bound on this file"):
            read(path, 1024, "--prompt-file")
    gzip_of_zeros(tmp_path / "bomb.gz", 3 << 20)  # 3 MiB decompressed
    assert (tmp_path / "bomb.gz").stat().st_size < 1 << 20
    with pytest.raises(FileReadError, match="bomb.gz: larger than 1 MiB decompressed"):
        read_bytes(tmp_path / "bomb.gz", 1 << 20, gunzip=True)
    (tmp_path / "lines.gz").write_bytes(gzip.compress(b"0123456789\n" * 200))  # 2200 bytes in short lines
    lines = read_lines(tmp_path / "lines.gz", 1000)
    assert next(lines) == (1, b"0123456789\n")
    with pytest.raises(FileReadError, match="lines.gz: larger than 1000 bytes decompressed"):
        list(lines)
    (tmp_path / "one_line").write_bytes(b"x" * 600 + b"\n")
    with pytest.raises(FileReadError, match="larger than 512 bytes"):
        list(read_lines(tmp_path / "one_line", 512))


def test_devices_fifos_and_directories_are_refused_unread(tmp_path):
    os.mkfifo(tmp_path / "fifo")  # no writer: opening it for reading the usual way would block forever
    cases = {"/dev/null": "a character device", str(tmp_path / "fifo"): "a FIFO", str(tmp_path): "a directory"}
    for path, kind in cases.items():
        for read in (read_bytes, check_file, lambda p, n, w: list(read_lines(p, n, w))):
            with deadline(10), pytest.raises(FileReadError, match=f"^--samples {path}: {kind}, not a regular file"):
                read(path, 1 << 20, "--samples")
    with pytest.raises(FileReadError, match="nope: no such file"):
        read_bytes(tmp_path / "nope", 10)


def test_undecodable_input_is_one_message(tmp_path):
    (tmp_path / "latin1.txt").write_bytes("cafés".encode("latin-1"))
    with pytest.raises(FileReadError, match=r"latin1.txt: not UTF-8 text \(invalid continuation byte at byte 3\)"):
        read_text(tmp_path / "latin1.txt", 100, "--infill")
    (tmp_path / "cut.gz").write_bytes(gzip.compress(b"x\n" * 1000)[:30])
    with pytest.raises(FileReadError, match="cut.gz: cannot read"):
        read_bytes(tmp_path / "cut.gz", 1 << 20, gunzip=True)


def test_json_lines_are_objects_one_a_line_each_refusal_naming_the_line(tmp_path):
    """The one JSON-lines reader (evaluation's problems and samples, generate.py's --prompt-file): blank lines skipped,
    .gz alike, bounded; a line that is not UTF-8, not JSON, too deep or not an object names its file and line."""
    rows = b'{"a": 1}\n\n  \n{"b": "\xc3\xa9"}\n'
    (tmp_path / "r.jsonl.gz").write_bytes(gzip.compress(rows))
    assert list(read_jsonl(tmp_path / "r.jsonl.gz", len(rows))) == [(1, {"a": 1}), (4, {"b": "é"})]
    with pytest.raises(FileReadError, match=f"^--samples {tmp_path / 'r.jsonl.gz'}: larger than 20 bytes"):
        list(read_jsonl(tmp_path / "r.jsonl.gz", 20, "--samples"))
    for line, message in ((b"[1]", "expected a JSON object, got list"), (b"{bad", "not valid JSON"),
                          (b"\xff{}", "not UTF-8 text"), (b"[" * 100_000, "JSON nested too deeply")):
        (tmp_path / "bad.jsonl").write_bytes(b'{"ok": 1}\n' + line + b"\n")
        with pytest.raises(FileReadError, match=f"^{tmp_path / 'bad.jsonl'}:2: {message}"):
            list(read_jsonl(tmp_path / "bad.jsonl", 1 << 20))
    (tmp_path / "lfs.jsonl").write_bytes(b"version https://git-lfs.github.com/spec/v1\noid sha256:0\n")
    with pytest.raises(FileReadError, match="a Git LFS pointer, not the data"):
        list(read_jsonl(tmp_path / "lfs.jsonl", 1 << 20))
    assert list(json_objects(enumerate(['{"p": "x"}', "", '{"p": "y"}'], 1), "p.jsonl")) == [(1, {"p": "x"}),
                                                                                             (3, {"p": "y"})]


def test_tokenizer_files_are_bounded_before_the_library_reads_them(tmp_path, monkeypatch):
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps({"model": {"type": "BPE", "vocab": {}, "merges": []}}) + " " * 4096)
    monkeypatch.setattr(tokenizer, "MAX_TOKENIZER_FILE_BYTES", 4096)
    with pytest.raises(TokenizerError, match=f"--tokenizer-model {path}: .*larger than 4 KiB, the bound on this "
                                             f"file"):
        build_tokenizer("HFTokenizer", tokenizer_model=str(path))


def test_mbpp_files_are_bounded_and_regular(tmp_path, monkeypatch):
    with pytest.raises(BenchmarkError, match="--decontaminate-data mbpp: /dev/null: a character device, not a "
                                             "regular file"):
        read_mbpp("/dev/null")
    monkeypatch.setattr(decontaminate, "MAX_MBPP_BYTES", 1 << 20)
    gzip_of_zeros(tmp_path / "mbpp.jsonl.gz", 2 << 20)
    with pytest.raises(BenchmarkError, match="mbpp.jsonl.gz: larger than 1 MiB decompressed"):
        read_mbpp(tmp_path / "mbpp.jsonl.gz")
