"""The tools given /dev/zero where a file is meant (the issue's reproduction: generate.py --prompt-file grew to 24 GB
before the kernel killed it; evaluate_humaneval.py --samples / --problems ended in MemoryError tracebacks) end in one
error line naming the file, in seconds, reading nothing. Each runs as a user runs it, under a 3 GiB address-space
limit so that a tool that did read the device fails fast instead of taking the machine's memory."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from codegeex_train.checkpoint import save_model_checkpoint, split_state_dict
from codegeex_train.tokenization.tokenizer import default_tokenizer
from codegeex_train.model import CodeGeeXModel, ModelConfig

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 3 << 30


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT, LIMIT))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    config = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=default_tokenizer().vocab_size,
                         max_position_embeddings=64)
    path = tmp_path_factory.mktemp("zero") / "ckpt"
    save_model_checkpoint(path, split_state_dict(CodeGeeXModel(config, None, None).state_dict(), config, 1), config, 1)
    return path


SLOW = pytest.mark.slow  # a few seconds each: torch's import


@pytest.mark.parametrize("tool, args, message", [
    pytest.param("generate", ["--load", "{ckpt}", "--prompt-file", "/dev/zero"],
                 "--prompt-file /dev/zero: a character device", marks=SLOW),
    pytest.param("evaluate_humaneval", ["--samples", "/dev/zero"], "--samples /dev/zero: a character device",
                 marks=SLOW),
    pytest.param("evaluate_humaneval", ["--canonical", "--problems", "/dev/zero"], "/dev/zero: a character device",
                 marks=SLOW),
    ("plot_metrics", ["/dev/zero", "-o", "{tmp}/plot.png"], "/dev/zero: a character device"),
])
def test_dev_zero_is_one_error_line(ckpt, tmp_path, tool, args, message):
    argv = [a.format(ckpt=ckpt, tmp=tmp_path) for a in args]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}  # this checkout's package
    result = subprocess.run([sys.executable, str(ROOT / "tools" / f"{tool}.py"), *argv], capture_output=True,
                            text=True, timeout=120, cwd=tmp_path, env=env, preexec_fn=_limit_memory)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    assert lines[-1].startswith(f"{tool}.py: error: ") and message in lines[-1], result.stderr
