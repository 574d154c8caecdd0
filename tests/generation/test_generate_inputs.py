"""tools/generate.py's inputs (in this process, on a tiny checkpoint): text that is not UTF-8 (bytes on the command
line or stdin, a JSON lone surrogate) is one error line, never a tokenizer's traceback, and an interactive session
goes on after it; a prompt file is a regular file of at most MAX_INPUT_BYTES (decompressed), a prompt on stdin at
most as long."""

from __future__ import annotations

import gzip
import io
import json
import sys

import pytest

from codegeex_train.checkpoint import save_model_checkpoint, split_state_dict
from codegeex_train.tokenization.tokenizer import default_tokenizer
from codegeex_train.model import CodeGeeXModel, ModelConfig
from tests.harness import load_tool


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen_inputs")
    config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=default_tokenizer().vocab_size,
                         max_position_embeddings=64, init_method_std=0.2)
    save_model_checkpoint(root / "ckpt", split_state_dict(CodeGeeXModel(config, None, None, seed=5).state_dict(),
                                                          config, 1), config, 1)
    return root / "ckpt"


def error_line(capsys, tool, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as e:
        tool.main(["--load", str(argv[0]), *argv[1:], "--max-new-tokens", "4"])
    assert e.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert "Traceback" not in "\n".join(err)
    assert len([line for line in err if "error:" in line]) == 1 and err[-1].startswith("generate.py: error: "), err
    return err[-1]


def test_text_that_is_not_utf8_is_one_error_line(ckpt, tmp_path, capsys):
    tool = load_tool("generate")
    # Python hands bytes that are not UTF-8 on the command line over as lone surrogates (U+DC80..U+DCFF).
    assert "--prompt: not UTF-8 text (the byte 0xff at character 4)" in error_line(
        capsys, tool, [ckpt, "--prompt", "def \udcff(x):"])
    assert "--stop (string 2): not UTF-8 text (the byte 0xfe at character 1)" in error_line(
        capsys, tool, [ckpt, "--prompt", "x", "--stop", "\\n", "a\udcfe"])
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "ok"}) + "\n" + '{"prompt": "a\\ud800b"}\n')
    assert f"--prompt-file {tmp_path / 'p.jsonl'} prompt 2: not UTF-8 text (a lone surrogate U+D800 at character 1)" \
        in error_line(capsys, tool, [ckpt, "--prompt-file", str(tmp_path / "p.jsonl")])


def test_an_interactive_prompt_that_is_not_utf8_is_refused_and_the_session_goes_on(ckpt, capsys, monkeypatch):
    tool = load_tool("generate")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"def \xff(x):\n.\ndef f(x):\n"), "utf-8"))
    tool.main(["--load", str(ckpt), "--max-new-tokens", "4"])
    out, err = capsys.readouterr()
    assert "generate.py: error: a prompt on stdin: not UTF-8 text (invalid start byte at byte 4)" in err, err
    assert "Traceback" not in err and out.strip(), (out, err)  # the second prompt's completion


def test_prompt_files_are_regular_and_bounded(ckpt, tmp_path, capsys, monkeypatch):
    tool = load_tool("generate")
    assert "--prompt-file /dev/null: a character device, not a regular file" in error_line(
        capsys, tool, [ckpt, "--prompt-file", "/dev/null"])
    monkeypatch.setattr(tool, "MAX_INPUT_BYTES", 1024)
    (tmp_path / "long.py").write_text("x = 1\n" * 200)
    assert f"--prompt-file {tmp_path / 'long.py'}: larger than 1 KiB, the bound on this file" in error_line(
        capsys, tool, [ckpt, "--prompt-file", str(tmp_path / "long.py")])
    (tmp_path / "bomb.py.gz").write_bytes(gzip.compress(b"#" * 4096))
    assert "bomb.py.gz: larger than 1 KiB decompressed" in error_line(
        capsys, tool, [ckpt, "--prompt-file", str(tmp_path / "bomb.py.gz")])


def test_a_prompt_on_stdin_is_bounded_and_the_next_one_still_read(monkeypatch):
    tool = load_tool("generate")
    monkeypatch.setattr(tool, "MAX_INPUT_BYTES", 64)
    stdin = io.BytesIO(b"#" * 50 + b"\n" + b"#" * 50 + b"\n.\ndef f():\r\n    return 1\n")
    with pytest.raises(tool.GenerateError, match="a prompt on stdin: larger than 64 bytes, the bound on one prompt"):
        tool.read_stdin_prompt(stdin)
    assert tool.read_stdin_prompt(stdin) == ("def f():\n    return 1\n", False)


def test_a_prompt_file_nested_past_the_limit_is_one_prompt_not_a_traceback(tmp_path):
    # Its first line nested past Python's recursion limit: json.loads raises RecursionError, not a decoding error.
    deep = "[" * 100_000 + "]" * 100_000
    (tmp_path / "deep.txt").write_text(deep + "\n")
    assert load_tool("generate").read_prompt_file(str(tmp_path / "deep.txt")) == [{"prompt": deep + "\n"}]
