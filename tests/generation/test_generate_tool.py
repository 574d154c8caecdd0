"""tools/generate.py end to end on a tiny checkpoint with the shipped tokenizer: one process, and torchrun
--nproc_per_node 2 at TP 2 (same output); --prompt to stdout, the interactive loop, and bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from codegeex_train.checkpoint import save_model_checkpoint, split_state_dict
from codegeex_train.tokenization.tokenizer import default_tokenizer
from codegeex_train.model import CodeGeeXModel, ModelConfig
from tests.harness import free_port, run_process_group

ROOT = Path(__file__).resolve().parents[2]
TOOL = str(ROOT / "tools" / "generate.py")
PROMPTS = [{"task_id": "t/0", "prompt": "def add(a, b):\n    "},
           {"task_id": "t/1", "prompt": "import os\n\n\nclass Config:\n    \"\"\"Settings.\"\"\"\n\n    def "
                                        "__init__(self):\n"},
           {"task_id": "t/2", "prompt": "x"}]
SAMPLE = ["--max-new-tokens", "12", "--temperature", "0.8", "--top-k", "50", "--top-p", "0.95", "--seed", "3",
          "--stop", "\\ndef", "\\nclass", "--batch-size", "2"]


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return run_process_group(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT, env=env, **kw)


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("gen_tool")
    config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=default_tokenizer().vocab_size,
                         max_position_embeddings=64, init_method_std=0.2)
    full = CodeGeeXModel(config, None, None, seed=5).state_dict()
    dirs = {}
    for tp in (1, 2):
        dirs[tp] = root / f"tp{tp}"
        save_model_checkpoint(dirs[tp], split_state_dict(full, config, tp), config, tp)
    (root / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return {"root": root, **dirs}


@pytest.mark.slow
def test_tp1_and_torchrun_tp2_write_the_same_completions(tiny_ckpt):
    root = tiny_ckpt["root"]
    single = run([sys.executable, TOOL, "--load", str(tiny_ckpt[1]), "--prompt-file", str(root / "prompts.jsonl"),
                  "--output", str(root / "tp1.jsonl"), *SAMPLE])
    assert single.returncode == 0, single.stderr
    launched = run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                    str(free_port()), TOOL, "--load", str(tiny_ckpt[2]), "--tensor-model-parallel-size", "2",
                    "--prompt-file", str(root / "prompts.jsonl"), "--output", str(root / "tp2.jsonl"), *SAMPLE])
    assert launched.returncode == 0, launched.stderr
    tp1 = [json.loads(line) for line in (root / "tp1.jsonl").read_text().splitlines()]
    tp2 = [json.loads(line) for line in (root / "tp2.jsonl").read_text().splitlines()]
    assert [{k: r[k] for k in ("task_id", "prompt")} for r in tp1] == PROMPTS
    assert all(r["completion"] and "\ndef" not in r["completion"] for r in tp1)
    assert tp2 == tp1
    assert "wrote 3 completion(s)" in single.stderr


@pytest.mark.slow
def test_prompt_to_stdout_and_interactive(tiny_ckpt):
    greedy = ["--max-new-tokens", "6"]
    once = run([sys.executable, TOOL, "--load", str(tiny_ckpt[1]), "--prompt", "def f(x):\\n", *greedy])
    assert once.returncode == 0, once.stderr
    assert once.stdout.startswith("def f(x):\n") and len(once.stdout) > len("def f(x):\n\n")
    completion = once.stdout[len("def f(x):\n"):-1]  # print() adds the last newline
    session = run([sys.executable, TOOL, "--load", str(tiny_ckpt[1]), *greedy],
                  input="def f(x):\n.\n.\ndef f(x):\n")  # a prompt, an empty one (ignored), a last one at EOF
    assert session.returncode == 0, session.stderr
    assert session.stdout == f"{completion}\n{'-' * 40}\n{completion}\n"


@pytest.mark.slow
@pytest.mark.parametrize("args, message", [
    (["--load", "{d}/nope", "--prompt", "x"], "latest does not exist"),
    (["--load", "{tp2}", "--prompt", "x"], "is split for TP 2 x PP 1; this run has TP 1: run with --tensor-model-parallel-size 2"),
    (["--load", "{tp1}", "--prompt-file", "{d}/bad.jsonl"], "bad.jsonl:2: not valid JSON"),
    (["--load", "{tp1}", "--prompt", "x", "--top-p", "0"], "--top-p"),
    (["--load", "{tp1}", "--prompt", "x" * 200], "positions (--max-position-embeddings)"),
])
def test_bad_input_is_one_error_line(tiny_ckpt, args, message):
    d = tiny_ckpt["root"]
    (d / "bad.jsonl").write_text('{"prompt": "a"}\n{"prompt": \n')
    args = [a.format(d=d, tp1=tiny_ckpt[1], tp2=tiny_ckpt[2]) for a in args]
    result = run([sys.executable, TOOL, *args])
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("generate.py: error: ") and message in last, result.stderr
    assert "Traceback" not in result.stderr
