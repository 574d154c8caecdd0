"""tools/preprocess_data.py on hostile input: bad lines, oversized documents, a dead worker, signals, a full disk.

Every failure is one ``preprocess_data.py: error: ...`` line, in bounded time, and leaves no output: no .bin/.idx,
no .tmp. Each test bounds its own time (``deadline`` for in-process runs, ``timeout=`` for subprocesses), so a hang
fails instead of stalling the suite.
"""

import glob
import gzip
import importlib.util
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
import tracemalloc
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from codegeex_train.preprocessing import preprocess as preprocess_module
from codegeex_train.preprocessing.corpus import CorpusError, CorpusStats, iter_documents
from codegeex_train.data.indexed_dataset import MMapIndexedDataset
from codegeex_train.preprocessing.preprocess import TokenizerSpec, preprocess
from tests.harness import deadline

TOOL = Path(__file__).resolve().parents[2] / "tools" / "preprocess_data.py"
SPEC = TokenizerSpec(whitespace_encoding=True)
GOOD = [json.dumps({"text": f"def f{i}(x):\n    return x + {i}\n"}) for i in range(300)]  # ~12 KB: past read-ahead
BAD_LINES = {  # kind -> (the line's bytes, what the error says)
    "invalid UTF-8": (b'{"text": "caf\xe9"}', "not UTF-8"),
    "invalid JSON": (b'{"text": "unterminated', "not valid JSON"),
    "nested too deeply": (b'{"text": "x", "n": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "JSON nested too deeply"),
    "lone surrogate": (b'{"text": "a\\ud800b"}', "field 'text' holds a lone surrogate"),
    "array": (b'["text", "x"]', "not a JSON object (a JSON array)"),
    "string": (b'"text"', "not a JSON object (a JSON string)"),
    "missing key": (b'{"content": "x"}', "no string field 'text'"),
    "non-string key": (b'{"text": 3}', "no string field 'text'"),
    "huge integer": (b'{"text": "x", "n": ' + b"9" * 5000 + b"}", "an integer of more than"),
}
BAD_LINE_NUMBER = len(GOOD) + 1
ERROR_PREFIX = "preprocess_data.py: error: "




def _tool():
    spec = importlib.util.spec_from_file_location("preprocess_data_tool", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def _one_error_line(stderr: str) -> str:
    """The tool's only error line, which must be the last line of stderr; no traceback."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert "Traceback" not in stderr, stderr
    assert lines and lines[-1].startswith(ERROR_PREFIX), stderr
    assert sum(line.startswith(ERROR_PREFIX) for line in lines) == 1, stderr
    return lines[-1]


def _fails(capsys, argv: list[str], seconds: int = 60) -> str:
    with deadline(seconds), pytest.raises(SystemExit) as exit_info:
        _tool().main(argv)
    code = exit_info.value.code
    assert code not in (0, None)
    stderr = capsys.readouterr().err
    return _one_error_line(stderr + "\n" + code if isinstance(code, str) else stderr)  # sys.exit(message)


def _written(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.is_file())


def _jsonl(path: Path, lines: list[bytes | str]) -> Path:
    data = b"".join((line.encode() if isinstance(line, str) else line) + b"\n" for line in lines)
    path.write_bytes(gzip.compress(data) if path.name.endswith(".gz") else data)
    return path


# ---- bad lines: the true line number, and --skip-bad-lines skips every kind ----


@pytest.mark.parametrize("kind", list(BAD_LINES))
@pytest.mark.parametrize("name", ["bad.jsonl", "bad.jsonl.gz"])
def test_bad_line_is_reported_at_its_true_line_and_skipped(tmp_path, kind, name):
    line, fragment = BAD_LINES[kind]
    path = _jsonl(tmp_path / name, [*GOOD, line, GOOD[0]])
    with pytest.raises(CorpusError) as error:
        list(iter_documents([str(path)]))
    assert f"{name}:{BAD_LINE_NUMBER}: {fragment}" in str(error.value)
    assert "--skip-bad-lines" in str(error.value)
    stats = CorpusStats()
    assert len(list(iter_documents([str(path)], skip_bad_lines=True, stats=stats))) == len(GOOD) + 1
    assert stats.skipped == 1


def test_cli_skips_every_kind_of_bad_line_and_counts_them(tmp_path, capsys):
    lines = [GOOD[0], *(line for line, _ in BAD_LINES.values()), GOOD[1]]
    path = _jsonl(tmp_path / "dirty.jsonl", lines)
    out = tmp_path / "out"
    line = _fails(capsys, ["--input", str(path), "--output-prefix", str(out / "p"), "--whitespace-encoding"])
    assert "dirty.jsonl:2: not UTF-8" in line and "--skip-bad-lines" in line
    assert not out.exists() or _written(out) == []
    with deadline(60):
        _tool().main(["--input", str(path), "--output-prefix", str(out / "p"), "--whitespace-encoding",
                      "--skip-bad-lines", "--workers", "2"])
    assert f"skipped {len(BAD_LINES)} bad records" in capsys.readouterr().out
    tokenizer = SPEC.build()
    expected = [tokenizer.encode(json.loads(GOOD[i])["text"]) for i in (0, 1)]
    assert [d.tolist() for d in MMapIndexedDataset(str(out / "p_text_document"))] == expected


# ---- oversized documents: skipped and counted before the tokenizer, huge lines never held whole ----


def test_oversized_documents_are_skipped_before_the_tokenizer(tmp_path, monkeypatch, capsys):
    limit = 1000
    big_line = json.dumps({"text": "x = 1\n" * 700_000})  # 4.2 MB: over the line cap, skipped unparsed
    lines = [GOOD[0], big_line, json.dumps({"text": "y" * (limit + 1)}), json.dumps({"text": "z" * limit}), GOOD[1]]
    path = _jsonl(tmp_path / "big.jsonl", lines)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "huge.py").write_bytes(b"\xff" * (4 * limit + 1))  # > 4 bytes a char: skipped unread
    (tmp_path / "src" / "long.py").write_text("w" * (limit + 1))
    (tmp_path / "src" / "ok.py").write_text("v = 2\n")
    seen: list[int] = []
    encode = preprocess_module._encode
    monkeypatch.setattr(preprocess_module, "_encode",
                        lambda tok, texts, eod: seen.extend(map(len, texts)) or encode(tok, texts, eod))
    summary = preprocess([str(path), str(tmp_path / "src")], str(tmp_path / "out" / "p"), SPEC,
                         max_document_chars=limit, progress=False)
    assert (summary.documents, summary.skipped_oversized) == (4, 4)
    assert max(seen) == limit and len(seen) == 4
    assert "skipped 4 documents over --max-document-chars 1000" in str(summary)
    path = _jsonl(tmp_path / "long.jsonl", lines[2:])
    summary = preprocess([str(path)], str(tmp_path / "out" / "all"), SPEC, max_document_chars=0, progress=False)
    assert (summary.documents, summary.skipped_oversized) == (3, 0)  # 0: no limit
    with pytest.raises(SystemExit):
        _tool().parse_args(["--output-prefix", "x", "--max-document-chars", "-1"])
    assert "--max-document-chars -1: must be >= 0" in _one_error_line(capsys.readouterr().err)


def test_a_huge_line_is_never_held_in_memory(tmp_path):
    line = json.dumps({"text": "a" * (16 << 20)})
    path = _jsonl(tmp_path / "huge.jsonl", [line, GOOD[0]])
    del line
    stats = CorpusStats()
    tracemalloc.start()
    try:
        docs = list(iter_documents([str(path)], stats=stats, max_chars=1000))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (len(docs), stats.oversized) == (1, 1)
    assert peak < 4 << 20, f"peak {peak} bytes while skipping a 16 MB line"


# ---- a dead worker: one line at once, never a hang ----


MARKER = "# the out-of-memory killer strikes here"


def _killed_on_marker(tokenizer, texts, append_eod):
    if any(MARKER in text for text in texts):
        os.kill(os.getpid(), signal.SIGKILL)  # what the OOM killer does: no exception, no cleanup
    return ENCODE(tokenizer, texts, append_eod)


ENCODE = preprocess_module._encode


def test_a_worker_killed_by_sigkill_ends_the_run_with_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(preprocess_module, "_encode", _killed_on_marker)  # forked workers inherit it
    path = _jsonl(tmp_path / "docs.jsonl", [*GOOD[:64], json.dumps({"text": MARKER}), *GOOD[64:128]])
    out = tmp_path / "out"
    start = time.monotonic()
    line = _fails(capsys, ["--input", str(path), "--output-prefix", str(out / "p"), "--workers", "2"], seconds=30)
    assert "a tokenizer worker died (killed by signal 9 (SIGKILL)" in line and "nothing was written" in line
    assert time.monotonic() - start < 30
    assert _written(out) == []
    assert multiprocessing.active_children() == []  # the other worker is gone too


def _signal_state():
    return signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM), signal.pthread_sigmask(signal.SIG_BLOCK, [])


def test_workers_leave_ctrl_c_to_the_main_process_and_die_on_sigterm():
    pool = ProcessPoolExecutor(1, initializer=preprocess_module._init_worker, initargs=(SPEC, False))
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)  # the tool's handler, inherited by a fork
    try:
        with pool, deadline(30):
            with preprocess_module._interrupts_held():  # as the pool starts them: forked with both signals blocked
                state = pool.submit(_signal_state)
            assert state.result() == (signal.SIG_IGN, signal.SIG_DFL, set())
    finally:
        signal.signal(signal.SIGTERM, previous)


def _children(pid: int) -> list[int]:
    return [int(c) for f in glob.glob(f"/proc/{pid}/task/*/children") for c in Path(f).read_text().split()]


def _start_tool(tmp_path: Path, workers: int) -> tuple[subprocess.Popen, Path]:
    docs = [json.dumps({"text": f"def g{i}(y):\n    return y * {i}\n" * 300}) for i in range(200)]  # ~1.8 MB
    path = _jsonl(tmp_path / "docs.jsonl", docs)
    out = tmp_path / "out"
    argv = [sys.executable, str(TOOL), "--input", str(path), "--output-prefix", str(out / "p"),
            "--workers", str(workers)]
    return subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, start_new_session=True), out


def _wait_for(condition, seconds: float = 30) -> None:
    end = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_cli_worker_sigkilled_from_outside(tmp_path):
    process, out = _start_tool(tmp_path, workers=2)
    try:
        _wait_for(lambda: len(_children(process.pid)) == 2)
        os.kill(process.pid, signal.SIGSTOP)  # the run cannot finish before the kill lands
        workers = _children(process.pid)
        os.kill(workers[0], signal.SIGKILL)
        os.kill(process.pid, signal.SIGCONT)
        stderr = process.communicate(timeout=30)[1]
    finally:
        process.kill()
    assert "killed by signal 9 (SIGKILL)" in _one_error_line(stderr)
    assert _written(out) == []
    assert not any(os.path.exists(f"/proc/{pid}") for pid in workers)


# ---- interrupted, or the disk fills up: nothing is left behind ----


@pytest.mark.parametrize("signum,workers", [(signal.SIGTERM, 1), (signal.SIGINT, 2)])
def test_cli_interrupted_leaves_nothing(tmp_path, signum, workers):
    process, out = _start_tool(tmp_path, workers)
    try:
        _wait_for(lambda: (out / "p_text_document.bin.tmp").exists())
        os.killpg(process.pid, signum)  # Ctrl-C and a scheduler's cancel reach the whole process group
        stderr = process.communicate(timeout=30)[1]
    finally:
        process.kill()
    assert f"interrupted ({signal.Signals(signum).name}); no partial output is left" in _one_error_line(stderr)
    assert process.returncode == 128 + signum
    assert _written(out) == []


def test_a_failure_in_a_later_json_key_writes_no_key(tmp_path, capsys):
    lines = [json.dumps({"text": "a = 1\n", "content": "b = 2\n"}), json.dumps({"text": "c = 3\n"})]
    path = _jsonl(tmp_path / "two.jsonl", lines)
    out = tmp_path / "out"
    line = _fails(capsys, ["--input", str(path), "--output-prefix", str(out / "p"), "--json-keys", "text", "content"])
    assert "two.jsonl:2: no string field 'content'" in line
    assert _written(out) == []  # not even the complete "text" output: all keys or none


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs (needs root), all but 16 KiB of it taken."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    try:
        with open(disk / "filler", "wb") as f:
            f.write(b"\0" * ((1 << 20) - (16 << 10)))
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_disk_full_is_one_line_and_leaves_nothing(tmp_path, small_disk, capsys):
    path = _jsonl(tmp_path / "docs.jsonl", GOOD * 8)  # ~60 KB of tokens (uint16)
    line = _fails(capsys, ["--input", str(path), "--output-prefix", str(small_disk / "p")])
    assert "No space left on device" in line and "--output-prefix" in line and str(small_disk / "p") in line
    assert _written(small_disk) == ["filler"]
