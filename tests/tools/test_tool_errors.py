"""Every command ends bad input with one ``error:`` line on stderr and a non-zero exit, never a traceback.

Each case runs the command as a user would (a subprocess) on tiny inputs, in an empty working directory that it must
leave empty (every path it is given is absolute, so nothing can land in the checkout). The line is ``error: ...``
(the pretrain entry) or ``<tool>.py: error: ...`` (the tools, the same form as argparse's own errors), and it is
the last line of stderr."""

import re
import sys
from pathlib import Path

import pytest
import torch

from tests.harness import run_process_group, tiny_model_args

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tools"
ERROR_LINE = re.compile(r"^(?:[\w.-]+: )?error: \S")
MODEL = tiny_model_args()

COMMANDS = {
    "preprocess_data": [sys.executable, str(TOOLS / "preprocess_data.py")],
    "train_tokenizer": [sys.executable, str(TOOLS / "train_tokenizer.py")],
    "convert_checkpoint": [sys.executable, str(TOOLS / "convert_checkpoint.py")],
    "pretrain": [sys.executable, "-m", "codegeex_train.pretrain"],
}

# (command, arguments with {d} = a directory of bad inputs and {data} = a small dataset, what the line says)
CASES = [
    ("preprocess_data", "--input {d}/bad.jsonl --output-prefix {d}/out/p", "bad.jsonl:2: not valid JSON"),
    ("preprocess_data", "--input {d}/nope.jsonl --output-prefix {d}/out/p", "nope.jsonl: no such file"),
    ("preprocess_data", "--input {d}/good.jsonl --output-prefix {d}/out/p --tokenizer-model {d}/tokenizer.json",
     "--tokenizer-model"),
    ("preprocess_data", "--input {d}/good.jsonl --output-prefix {d}/out/p --workers 0", "--workers 0"),
    ("train_tokenizer", "--input {d}/bad.jsonl --output {d}/tok.json --vocab-size 300", "bad.jsonl:2"),
    ("train_tokenizer", "--input {d}/empty --output {d}/tok.json --vocab-size 300", "no documents found"),
    ("train_tokenizer", "--input {d}/good.jsonl --output {d}/tok.json --vocab-size 10", "--vocab-size 10"),
    ("convert_checkpoint", "--load {d}/empty --save {d}/out", "latest does not exist"),
    ("convert_checkpoint", "--load {d}/foreign --to-hf {d}/out", "not a codegeex_train model file"),
    ("convert_checkpoint", "--from-hf {d}/empty --save {d}/out", "no config.json"),
    ("pretrain", "--data-path {d}/nope", "--data-path"),
    ("pretrain", "--data-path {data} --load {d}/foreign", "not a codegeex_train model file"),
    ("pretrain", "--data-path {data} --tokenizer-type HFTokenizer --tokenizer-model {d}/tokenizer.json",
     "--tokenizer-model"),
    ("pretrain", "--data-path {data} --train-iters many", "--train-iters"),
]


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("bad")
    (d / "good.jsonl").write_text('{"text": "def f():\\n    return 1\\n"}\n')
    (d / "bad.jsonl").write_text('{"text": "def f(): pass"}\n{"text": "unterminated\n')
    (d / "tokenizer.json").write_text("{not json")
    (d / "empty").mkdir()
    (d / "foreign" / "iter_0000000").mkdir(parents=True)  # another program's checkpoint in our layout
    (d / "foreign" / "latest").write_text("iter_0000000")
    torch.save({"state_dict": {"w": torch.ones(2)}}, d / "foreign" / "iter_0000000" / "mp_rank_00_model_states.pt")
    return d


@pytest.mark.parametrize("command,args,fragment", CASES,
                         ids=[f"{c}-{i}" for i, (c, _, _) in enumerate(CASES)])
def test_bad_input_ends_with_one_error_line(request, bad_inputs, command, args, fragment, tmp_path):
    data = request.getfixturevalue("tiny_data") if "{data}" in args else None
    argv = args.format(d=bad_inputs, data=data).split()
    if command == "pretrain":
        argv = MODEL + argv
    result = run_process_group(COMMANDS[command] + argv, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert list(tmp_path.iterdir()) == []  # nothing written where it runs
    # No output written (preprocess_data may leave the empty directory of --output-prefix behind).
    assert [p for p in bad_inputs.glob("out/**/*") if not p.is_dir()] == [] and not (bad_inputs / "tok.json").exists()
    stderr = result.stderr
    assert result.returncode != 0, (result.stdout, stderr)
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert lines and ERROR_LINE.match(lines[-1]), stderr
    assert sum(bool(ERROR_LINE.match(line)) for line in lines) == 1, stderr
    assert fragment in lines[-1], lines[-1]
