"""Every shell command in README.md and docs/*.md, exercised as far as it can be without training.

The commands come from the fenced code blocks (```bash: every line is a command; ``` with no language: the lines
that start like one, the rest is program output), the 4-space indented blocks (the lines that start like a command)
and inline `code` spans that start with a program (`python ...`, `torchrun ...`, `make ...`). Backslash
continuations are joined and comments dropped; `#SBATCH` lines are kept (they are directives).

What each kind of command gets:

- `python tools/<tool>.py ARGS` (also `torchrun ... tools/generate.py ARGS`, a bare `tools/<tool>.py ARGS`) and
  `python benchmarks/<b>.py ARGS`: ARGS parsed by that tool's own parser (its parse_args / parse / build_parser /
  parser), with its own checks after parsing; nothing runs.
- `python -m codegeex_train.pretrain ARGS`, and the same under `deepspeed`, `torchrun` or `srun`: ARGS parsed by
  codegeex_train.config.arguments.parse_args; the launcher's own flags by the launcher's own parser
  (deepspeed.launcher.runner.parse_args, torch.distributed.run.get_args_parser).
- `python -m codegeex_train.accounting.planner ARGS` / `...distributed.topology ARGS`: run (in this process), exit 0.
  `python -m codegeex_train.config.megatron_flags > docs/megatron-flags.md`: run, and its output must equal the file.
- `[VARS] bash scripts/pretrain_codegen.sh ARGS`: run with DRY_RUN=1 in an empty temporary directory (a fake
  8-GPU `nvidia-smi` when the command asks for GPUs: DEVICE=gpu, HOSTFILE or CONFIG=codegeex-13b; no nvidia-smi at
  all otherwise; a temporary hostfile for HOSTFILE, a temporary directory for INIT_FROM), exit 0, nothing launched
  or written; then the launch command it prints is checked like a direct one: deepspeed's parser for the launcher
  part, parse_args and validate (at the printed number of ranks) for pretrain.py's part.

In the docs a literal `...` means "more flags": it is dropped (and flags the parser requires get placeholders), or,
right after a flag that takes a value, it is that value. `[--flag value]` is an optional part: it is kept. Shell
variables take the values in SHELL_VALUES, and N / K / UNIT placeholders those in PLACEHOLDERS.

Whatever cannot be exercised here (make targets that train or install, pip, SLURM directives and batch-script
plumbing, prose that names a program without arguments) is listed in RUN_BY_HAND with the reason; a documented
command that is neither exercised nor listed fails test_every_other_command_is_listed_to_run_by_hand.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import runpy
import shlex
import stat
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
SCRIPT = ROOT / "scripts" / "pretrain_codegen.sh"

# --- What is not exercised here, and why --------------------------------------------------------------------------
# Patterns are matched (re.fullmatch) against the whole command as extracted (continuations joined, comment dropped).
RUN_BY_HAND: dict[str, str] = {
    r"(\w+=\S+ )*make (pretrain|test|test-fast|humaneval-x-deps)":
        "make builds .venv (pip installs) and trains for ~5 min or runs the whole suite (~23 min), or installs "
        "HumanEval-X's toolchains with apt-get; run by hand "
        "(docs/figures.md has the timings). The target's existence is checked here, and `make pretrain` is "
        "`bash scripts/pretrain_codegen.sh`, whose dry run is exercised",
    r"python3 -m venv \.venv && \.venv/bin/pip install torch":
        "creates a virtual environment and installs torch from the network",
    r"pip install .*|pip --no-compile":
        "installs packages (network); `pip --no-compile` is a flag named in prose",
    r"#SBATCH .*": "a SLURM batch directive: read by sbatch only, no SLURM here",
    r"export MASTER_ADDR=\$\(scontrol show hostnames .*\) MASTER_PORT=29500":
        "needs scontrol and a SLURM allocation ($SLURM_JOB_NODELIST)",
    r"scancel --signal=TERM JOB": "SLURM's scancel: no SLURM here",
    r"srun --kill-on-bad-exit=1": "an srun flag named in prose (the full srun commands are exercised)",
    r"deepspeed --hostfile": "a launcher flag named in prose (the full deepspeed commands are exercised)",
    r"tools/convert_checkpoint\.py --load DIR":
        "names the tool and its input flag in prose; the full convert_checkpoint commands are exercised",
    r"python -I -B -S": "the sandbox's interpreter flags (docs/generation-and-evaluation.md), not a command",
    r"python -m codegeex_train\.accounting\.planner":
        "names the planner in prose; without a model (--config or the shape flags) it asks for one. "
        "Its full commands are run",
    r"python benchmarks/(generation|pipeline|preprocess_throughput|token_id_scan|memory_check)\.py( .*)?":
        "a benchmark of minutes; its parser is built inside main(), so it cannot be parsed without running",
    r"MALLOC_MMAP_THRESHOLD_=4194304 MALLOC_TRIM_THRESHOLD_=4194304":
        "environment values to put in front of a launch (tests/training/test_memory_flat.py and "
        "tests/scripts/test_pretrain_script.py check the script sets them), not a command",
    # docs/clusters-preemption.md's SLURM recipes: the batch script around the launch
    r"SAVE=/shared/codegeex/run1; LOAD=\(\); \[ -f \"\$SAVE/latest\" \] && LOAD=\(--load \"\$SAVE\"\)":
        "batch-script plumbing of a SLURM recipe (the srun line after it is exercised)",
    r"rm -f \"\$SAVE/preempted\"|status=0|exit \"\$status\"":
        "batch-script plumbing of a SLURM recipe (the srun/torchrun line is exercised)",
    r"\[ \"\$status\" -eq 0 \] \|\| \[ .* \] \|\| status=0":
        "batch-script plumbing of a SLURM recipe: the exit status from the preempted marker",
    r"trap 'kill -TERM -- \"-\$pid\"' TERM|wait \"\$pid\"; status=\$\?|if \[ \"\$status\" -gt 128 \]; then .*; fi":
        "batch-script plumbing of a SLURM recipe: passing SIGTERM on (tests/cluster/test_failures.py runs the "
        "script under the same signals)",
}

# Shell variables the documented commands use, with values a real job would give them.
SHELL_VALUES = {"SLURM_NNODES": "2", "SLURM_NODEID": "0", "MASTER_ADDR": "node-01", "MASTER_PORT": "29500",
                "SAVE": "/shared/codegeex/run1"}
# Placeholders the docs use where a number (or a name from a fixed set) goes.
PLACEHOLDERS = {"N": "2", "K": "0", "UNIT": "a"}
# Expands to `--load "$SAVE"` or to nothing: nothing (a first launch).
DROPPED_WORDS = {"${LOAD[@]}"}

COMMAND_WORDS = {"python", "python3", "torchrun", "deepspeed", "srun", "sbatch", "scancel", "scontrol", "bash",
                 "setsid", "make", "pip", "export"}
PATH_PREFIXES = ("tools/", "scripts/", "benchmarks/", ".venv/", "./")
ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
OPERATORS = {"&&", "||", "&", "|", ";"}
PLACEHOLDER = "PLACEHOLDER"
SRUN_VALUE_FLAGS = {"--ntasks", "--ntasks-per-node", "--nodes", "-n", "-N", "--gpus-per-node", "--cpus-per-task",
                    "-c", "--time", "-t", "--partition", "-p", "--signal"}
# Variables of the outer environment that the script reads: each run sets its own.
SCRIPT_VARS = ("OUTPUT_DIR", "CONFIG", "DEVICE", "NUM_GPUS", "HOSTFILE", "TP", "PP", "MICRO_BATCH", "MICRO_BATCHES",
               "GLOBAL_BATCH", "TRAIN_ITERS", "SEQ_LENGTH", "DATA_PATH", "TOKENIZER_ARGS", "DS_CONFIG", "LR", "MIN_LR",
               "DECAY", "WARMUP", "LAUNCHER_ARGS", "INIT_FROM", "DRY_RUN", "DS_ACCELERATOR", "DS_ENV_FILE",
               "OMP_NUM_THREADS", "TORCH_EXTENSIONS_DIR", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "PYTHON")
RUN_MODULES = {"codegeex_train.accounting.planner", "codegeex_train.distributed.topology",
               "codegeex_train.config.megatron_flags"}


# --- Extraction ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DocCommand:
    file: str  # relative to the repository root
    line: int
    text: str
    block: str  # "bash" (every line a command), "plain" (``` or indented: recognised lines), "inline"

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.text}"


def strip_comment(line: str) -> str:
    """The line without a shell comment (`#` starting a word outside quotes); `#SBATCH` directives are kept."""
    return split_comment(line)[0]


def split_comment(line: str) -> tuple[str, str]:
    """(the line's code, its comment)."""
    if line.lstrip().startswith("#SBATCH"):
        return line.strip(), ""
    quote = None
    i = 0
    while i < len(line):
        c = line[i]
        if quote:
            if c == "\\" and quote == '"':
                i += 1
            elif c == quote:
                quote = None
        elif c == "\\":
            i += 1
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i:]
        i += 1
    return line.rstrip(), ""


def looks_like_command(text: str) -> bool:
    """A line of a ``` / indented block that is a command rather than program output."""
    if text.startswith("#SBATCH"):
        return True
    try:
        words = shlex.split(text)
    except ValueError:
        words = text.split()
    rest = list(words)
    while rest and ASSIGNMENT.match(rest[0]):
        rest.pop(0)
    if words and not rest:  # VAR=value only
        return True
    first = rest[0] if rest else ""
    return first in COMMAND_WORDS or first.startswith(PATH_PREFIXES)


def logical_lines(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Backslash continuations joined, comments dropped, blank lines left out: (first line number, text). A comment
    that offers another command (`cmd  # or: other-cmd`) gives that command too."""
    out, buf, start = [], "", 0
    for number, raw in lines:
        text = raw.strip()
        if buf:
            text = f"{buf} {text}"
        else:
            start = number
        if text.endswith("\\"):
            buf = text[:-1].rstrip()
            continue
        buf = ""
        code, comment = split_comment(text)
        if code:
            out.append((start, code))
        alternative = re.fullmatch(r"#\s*or:\s*(.+)", comment.strip())
        if alternative and looks_like_command(alternative.group(1)):
            out.append((start, alternative.group(1).strip()))
    if buf:
        out.append((start, strip_comment(buf)))
    return out


def extract(path: Path, name: str | None = None) -> list[DocCommand]:
    """Every command of one markdown file, in order."""
    name = name or str(path.relative_to(ROOT))
    lines = path.read_text().splitlines()
    commands = []
    prose = list(lines)  # the file with its code blocks blanked out, for the inline spans
    i = 0
    while i < len(lines):
        fence = re.match(r"\s*```\s*(\S*)", lines[i])
        if fence:
            language = fence.group(1).lower()
            j = i + 1
            while j < len(lines) and not re.match(r"\s*```", lines[j]):
                j += 1
            body = [(n + 1, lines[n]) for n in range(i + 1, j)]
            for n in range(i, min(j + 1, len(lines))):
                prose[n] = ""
            if language in ("bash", "sh", "shell", "console"):
                commands += [DocCommand(name, n, t, "bash") for n, t in logical_lines(body)]
            elif language == "":
                commands += [DocCommand(name, n, t, "plain") for n, t in logical_lines(body) if looks_like_command(t)]
            i = j + 1
            continue
        if lines[i].startswith("    ") and (i == 0 or not lines[i - 1].strip()):
            j = i
            while j < len(lines) and (lines[j].startswith("    ") or not lines[j].strip()):
                j += 1
            body = [(n + 1, lines[n]) for n in range(i, j)]
            for n in range(i, j):
                prose[n] = ""
            commands += [DocCommand(name, n, t, "plain") for n, t in logical_lines(body) if looks_like_command(t)]
            i = j
            continue
        i += 1
    text = "\n".join(prose)
    for m in re.finditer(r"`([^`]+)`", text):
        span = " ".join(m.group(1).split())
        words = span.split()
        rest = words
        while rest and ASSIGNMENT.match(rest[0]):
            rest = rest[1:]
        if len(rest) >= 2 and (rest[0] in COMMAND_WORDS or rest[0].startswith(PATH_PREFIXES)):
            commands.append(DocCommand(name, text.count("\n", 0, m.start()) + 1, span, "inline"))
    return sorted(commands, key=lambda c: c.line)


def all_commands() -> list[DocCommand]:
    return [c for path in DOC_FILES for c in extract(path)]


# --- Classification -----------------------------------------------------------------------------------------------

@dataclass
class Parsed:
    env: dict[str, str]
    argv: list[str]  # the command proper: wrappers (srun, setsid) and trailing plumbing (`& pid=$!`) removed
    redirect: str | None = None


def by_hand_reason(text: str) -> str | None:
    return next((reason for pattern, reason in RUN_BY_HAND.items() if re.fullmatch(pattern, text)), None)


def split_command(text: str) -> Parsed | None:
    """The one simple command a documented line runs, or None (shell constructs: listed to run by hand)."""
    try:
        words = shlex.split(text)
    except ValueError:
        return None
    segments, current = [], []
    for word in words:
        if word in OPERATORS:
            segments.append(current)
            current = []
        else:
            current.append(word)
    segments.append(current)
    head, rest = segments[0], segments[1:]
    # Only `cmd || status=$?` / `cmd & pid=$!`: anything else after an operator is a shell construct.
    if any(not seg or not all(ASSIGNMENT.match(w) for w in seg) for seg in rest):
        return None
    env = {}
    while head and ASSIGNMENT.match(head[0]):
        key, value = head.pop(0).split("=", 1)
        env[key] = value
    if head[:1] == ["setsid"]:
        head = head[1:]
    if head[:1] == ["srun"]:
        head = head[1:]
        while head and head[0].startswith("-"):
            flag = head.pop(0)
            if flag in SRUN_VALUE_FLAGS and head:
                head.pop(0)
    redirect = None
    if len(head) >= 2 and head[-2] == ">":
        redirect, head = head[-1], head[:-2]
    if not head or any(w in (">", ">>", "<", "2>") for w in head):
        return None
    return Parsed(env, head, redirect)


def kind_of(text: str) -> str | None:
    """How a command is exercised ("script", "pretrain", "tool", "run", "deepspeed", "torchrun"), or None."""
    parsed = split_command(text)
    if parsed is None:
        return None
    argv = parsed.argv
    first = argv[0]
    if parsed.redirect is not None:
        return "run" if first in ("python", "python3") and argv[1:2] == ["-m"] and argv[2] in RUN_MODULES else None
    if first == "bash" and len(argv) >= 2 and argv[1] in ("scripts/pretrain_codegen.sh", "scripts/gpu_check.sh"):
        return "script" if argv[1].endswith("pretrain_codegen.sh") else "tool"
    if first in ("python", "python3") and len(argv) >= 2:
        if argv[1] == "-m" and len(argv) >= 3:
            if argv[2] == "codegeex_train.pretrain":
                return "pretrain"
            return "run" if argv[2] in RUN_MODULES else None
        if re.fullmatch(r"(tools|benchmarks)/\w+\.py", argv[1]):
            return "tool" if _parse_fn_name(argv[1]) else None
        return None
    if re.fullmatch(r"tools/\w+\.py", first):
        return "tool"
    if first in ("deepspeed", "torchrun"):
        return first
    return None


# --- Parsing without running ----------------------------------------------------------------------------------------

class CommandError(AssertionError):
    pass


class _Captured(Exception):
    def __init__(self, parser):
        super().__init__()
        self.parser = parser


def parser_of(parse_fn) -> argparse.ArgumentParser:
    """The ArgumentParser that parse_fn builds, caught at its first parse (nothing is parsed)."""
    def grab(self, args=None, namespace=None):
        raise _Captured(self)

    with mock.patch.object(argparse.ArgumentParser, "parse_known_args", grab):
        try:
            parse_fn([])
        except _Captured as c:
            return c.parser
    raise AssertionError(f"{parse_fn} parsed nothing")


def _placeholder_values(action: argparse.Action) -> list[str]:
    if action.nargs == 0:
        return []
    value = (str(next(iter(action.choices))) if action.choices else
             "1" if action.type in (int, float) else PLACEHOLDER)
    return [value] * (action.nargs if isinstance(action.nargs, int) else 1)


def normalize(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`...` dropped ("more flags"; then the flags the parser requires get placeholders, since the rest of the
    command would give them), or a placeholder value right after a flag that takes one."""
    actions = parser._option_string_actions
    out, more = [], False
    for word in argv:
        if word != "...":
            out.append(word)
            continue
        action = actions.get(out[-1]) if out and out[-1].startswith("-") else None
        if action is not None and action.nargs not in (0, "?", "*"):
            out += _placeholder_values(action)[:1]
        else:
            more = True
    if more:
        given = {id(actions[w.split("=", 1)[0]]) for w in out if w.split("=", 1)[0] in actions}
        for action in parser._actions:
            if action.required and action.option_strings and id(action) not in given:
                out += [action.option_strings[0], *_placeholder_values(action)]
        for group in parser._mutually_exclusive_groups:
            if group.required and not any(id(a) in given for a in group._group_actions):
                action = group._group_actions[0]
                out += [action.option_strings[0], *_placeholder_values(action)]
    return out


def run_parse(parse_fn, argv: list[str], what: str, resolve_more: bool = True):
    """parse_fn(argv) after `...` is resolved (not for a launcher: its `...` belongs to the program it starts);
    argparse's error (or a check after parsing) is a CommandError."""
    if resolve_more:
        argv = normalize(parser_of(parse_fn), argv)
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            return parse_fn(argv)
    except SystemExit as e:
        if e.code in (0, None) and ("--help" in argv or "-h" in argv):
            return None
        raise CommandError(f"{what} refuses {shlex.join(argv)} (exit {e.code}):\n{err.getvalue()}{out.getvalue()}")


def _load_file(relpath: str):
    import importlib.util

    path = ROOT / relpath
    spec = importlib.util.spec_from_file_location(f"doc_{path.parent.name}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


_modules: dict[str, object] = {}


def _parse_fn_name(relpath: str) -> str | None:
    """The name of the function tools/X.py or benchmarks/X.py parses its command line with (a parse_args / parse
    of its own, or a build_parser / parser returning an ArgumentParser), read off its source; None if it has none."""
    source = (ROOT / relpath).read_text() if (ROOT / relpath).is_file() else ""
    return next((name for name in ("parse_args", "parse", "build_parser", "parser")
                 if re.search(rf"^def {name}\(", source, re.MULTILINE)), None)


def tool_parse_fn(relpath: str):
    """parse(argv) for tools/X.py or benchmarks/X.py, or None."""
    name = _parse_fn_name(relpath)
    if name is None:
        return None
    if relpath not in _modules:
        if relpath.startswith("tools/"):
            from tests.harness import load_tool

            _modules[relpath] = load_tool(Path(relpath).stem)
        else:
            _modules[relpath] = _load_file(relpath)
    fn = getattr(_modules[relpath], name)
    return fn if name in ("parse_args", "parse") else (lambda argv: fn().parse_args(argv))


def expand(argv: list[str]) -> list[str]:
    """Shell variables and the docs' placeholders replaced; `[--flag value]` brackets removed."""
    out = []
    for word in argv:
        if word in DROPPED_WORDS:
            continue
        if word in PLACEHOLDERS:
            out.append(PLACEHOLDERS[word])
            continue

        def value(m):
            if m.group(1) not in SHELL_VALUES:
                raise CommandError(f"${m.group(1)}: no value for this shell variable in SHELL_VALUES")
            return SHELL_VALUES[m.group(1)]

        word = re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", value, word)
        if word.startswith("[-"):
            word = word[1:]
        if word.endswith("]") and not word.startswith("["):
            word = word[:-1]
        out.append(word)
    return out


def parse_pretrain(argv: list[str]):
    from codegeex_train.config.arguments import parse_args

    return run_parse(parse_args, argv, "codegeex_train.pretrain's parse_args")


def parse_tool(relpath: str, argv: list[str]):
    fn = tool_parse_fn(relpath)
    if fn is None:
        raise CommandError(f"{relpath}: no parse_args / parse / build_parser / parser function to check it with")
    return run_parse(fn, argv, f"{relpath}'s parser")


def parse_target(target: str, is_module: bool, args: list[str]) -> str:
    if target in ("codegeex_train.pretrain", "codegeex_train/pretrain.py") or target.endswith("/pretrain.py"):
        parse_pretrain(args)
        return "pretrain.py's flags parsed"
    if not is_module and re.fullmatch(r"tools/\w+\.py", target):
        parse_tool(target, args)
        return f"{target}'s flags parsed"
    raise CommandError(f"{target}: not a program this test knows how to check")


def deepspeed_launch(argv: list[str]) -> str:
    from deepspeed.launcher.runner import parse_args as ds_parse_args

    if "..." in argv and not any(w.endswith(".py") or w == "--module" for w in argv):
        argv = [w for w in argv if w != "..."] + ["codegeex_train/pretrain.py", "..."]
    ns = run_parse(ds_parse_args, argv, "deepspeed's launcher", resolve_more=False)
    done = parse_target(ns.user_script, ns.module, ns.user_args)
    return f"deepspeed's parser accepts the launcher flags; {done}"


def torchrun_launch(argv: list[str]) -> str:
    from torch.distributed.run import get_args_parser

    if "..." in argv and not any(w.endswith(".py") or w == "-m" for w in argv):
        argv = [w for w in argv if w != "..."] + ["-m", "codegeex_train.pretrain", "..."]
    ns = run_parse(lambda a: get_args_parser().parse_args(a), argv, "torchrun", resolve_more=False)
    done = parse_target(ns.training_script, ns.module, ns.training_script_args)
    return f"torchrun's parser accepts the launcher flags; {done}"


def run_module(module: str, argv: list[str]) -> str:
    """`python -m module argv`, run in this process (no interpreter start-up): its stdout, or a CommandError unless
    it exits 0."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings(), \
            mock.patch.object(sys, "argv", [module, *argv]):
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module is imported already (harmless)
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    if code != 0:
        raise CommandError(f"python -m {module} {shlex.join(argv)} exited {code}:\n{err.getvalue()}{out.getvalue()}")
    return out.getvalue()


# --- The launch script, dry -----------------------------------------------------------------------------------------

def _executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def script_dry_run(env_doc: dict[str, str], args: list[str], tmp: Path) -> str:
    cwd, bin_dir, calls = tmp / "cwd", tmp / "bin", tmp / "calls"
    cwd.mkdir()
    bin_dir.mkdir()
    # Anything the script launches (it must launch nothing) records itself and fails; pretrain.py's own checks
    # (`--dry-run`) pass here: tests/scripts/test_dry_run.py runs them for real on the README's commands.
    for fake in ("deepspeed", "fake-python"):
        # the fake python runs the script's config reader (it reads CONFIG's file) and passes pretrain.py's checks
        checks = (f'[ "$1" = -m ] && exec {sys.executable} "$@"\ncase " $* " in *" --dry-run "*) exit 0 ;; esac\n'
                  if fake == "fake-python" else "")
        _executable(bin_dir / fake, f'#!/bin/sh\n{checks}echo "{fake} $*" >> "{calls}"\nexit 1\n')
    env_doc = dict(env_doc)
    tp, pp = (int(env_doc.get(k, "1")) if env_doc.get(k, "1").isdigit() else 1 for k in ("TP", "PP"))  # for nodes
    gpus = env_doc.get("DEVICE") == "gpu" or "HOSTFILE" in env_doc or env_doc.get("CONFIG") == "codegeex-13b"
    if gpus:
        lines = "".join(f"echo 'GPU {i}: NVIDIA H200 (UUID: GPU-{i})'\n" for i in range(8))
        _executable(bin_dir / "nvidia-smi", f'#!/bin/sh\n[ "$1" = -L ] || exit 1\n{lines}')
    if "HOSTFILE" in env_doc:
        # Two nodes of 8 GPUs, or as many as TP x PP needs (a 4-stage TP 8 pipeline spans 4 nodes).
        nodes = max(2, tp * pp // 8)
        hostfile = tmp / "hostfile"
        hostfile.write_text("".join(f"node-{n + 1:02d} slots=8\n" for n in range(nodes)))
        env_doc["HOSTFILE"] = str(hostfile)
    if "INIT_FROM" in env_doc:
        init = tmp / "init_from"
        init.mkdir()
        env_doc["INIT_FROM"] = str(init)
    system_path = [d for d in os.environ.get("PATH", os.defpath).split(os.pathsep)
                   if d and not (Path(d) / "nvidia-smi").exists()]
    env = {k: v for k, v in os.environ.items() if k not in SCRIPT_VARS}
    env.update(env_doc)
    env.update(DRY_RUN="1", PATH=os.pathsep.join([str(bin_dir), *system_path]), PYTHON=str(bin_dir / "fake-python"))
    proc = subprocess.run(["bash", str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60,
                          check=False)
    where = f"DRY_RUN=1 {shlex.join(f'{k}={v}' for k, v in env_doc.items())} bash scripts/pretrain_codegen.sh " \
            f"{shlex.join(args)}"
    if proc.returncode != 0:
        raise CommandError(f"{where}: exit {proc.returncode}\n{proc.stdout}{proc.stderr}")
    if calls.exists():
        raise CommandError(f"{where}: a dry run launched {calls.read_text()}")
    if list(cwd.iterdir()):
        raise CommandError(f"{where}: a dry run wrote {[p.name for p in cwd.iterdir()]}")
    lines = proc.stdout.splitlines()
    layout = dict(w.split("=", 1) for w in next(x for x in lines if x.startswith("codegeex_train: layout ")).split()[2:])
    words = shlex.split(lines[-1])
    while words and ASSIGNMENT.match(words[0]):
        words.pop(0)
    if words[:1] != ["deepspeed"]:
        raise CommandError(f"{where}: the printed launch command is not deepspeed's: {lines[-1]}")
    # The printed command, checked as a direct one: deepspeed's flags, then pretrain.py's, validated at its ranks.
    from deepspeed.launcher.runner import parse_args as ds_parse_args

    from codegeex_train.config.arguments import ConfigError, validate

    ns = run_parse(ds_parse_args, words[1:], f"{where}: deepspeed's launcher", resolve_more=False)
    if not ns.user_script.endswith("codegeex_train/pretrain.py"):
        raise CommandError(f"{where}: launches {ns.user_script}")
    args_parsed = parse_pretrain(ns.user_args)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            validate(args_parsed, int(layout["RANKS"]))
    except ConfigError as e:
        raise CommandError(f"{where}: pretrain.py would refuse the command the script prints: {e}") from None
    return (f"dry run exit 0 (layout {' '.join(f'{k}={v}' for k, v in layout.items())}); the printed launch parsed "
            f"by deepspeed's parser and pretrain.py's, validated at {layout['RANKS']} ranks")


# --- Exercising one command -----------------------------------------------------------------------------------------

def exercise(command: DocCommand, tmp_path: Path) -> str:
    """Check one documented command as far as it goes without training; what was done, or a CommandError."""
    kind = kind_of(command.text)
    parsed = split_command(command.text)
    if kind is None or parsed is None:
        raise CommandError(f"{command}: not a command this test can exercise")
    try:
        argv = expand(parsed.argv)
        if kind == "script":
            return script_dry_run(parsed.env, argv[2:], tmp_path)
        if kind == "pretrain":
            parse_pretrain(argv[3:])
            return "pretrain.py's flags parsed"
        if kind == "run":
            output = run_module(argv[2], argv[3:])
            if parsed.redirect is not None:
                target = ROOT / parsed.redirect
                if output != target.read_text():
                    raise CommandError(f"{parsed.redirect} is not what `python -m {argv[2]}` writes: regenerate it")
                return f"ran; its output equals {parsed.redirect}"
            return "ran, exit 0"
        if kind == "tool":
            if argv[0] == "bash":  # scripts/gpu_check.sh execs benchmarks/gpu.py with its arguments
                argv = ["python", "benchmarks/gpu.py", *argv[2:]]
            if argv[0] not in ("python", "python3"):
                argv = ["python", *argv]
            parse_tool(argv[1], argv[2:])
            return f"{argv[1]}'s parser accepts the flags"
        if kind == "deepspeed":
            return deepspeed_launch(argv[1:])
        if kind == "torchrun":
            return torchrun_launch(argv[1:])
    except CommandError as e:
        raise CommandError(f"{command}\n{e}") from None
    raise CommandError(f"{command}: unknown kind {kind}")


# --- The tests ------------------------------------------------------------------------------------------------------

COMMANDS = all_commands()
EXERCISED = [c for c in COMMANDS if by_hand_reason(c.text) is None and kind_of(c.text) is not None]


def _id(c: DocCommand) -> str:
    return f"{c.file}:{c.line}:{re.sub(r'[^A-Za-z0-9_.=/-]+', '_', c.text)[:56]}"


@pytest.fixture(autouse=True)
def _at_the_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # documented commands run from the checkout's root


@pytest.mark.parametrize("command", EXERCISED, ids=_id)
def test_documented_command(command, tmp_path):
    exercise(command, tmp_path)


def test_every_other_command_is_listed_to_run_by_hand():
    unlisted = [str(c) for c in COMMANDS if kind_of(c.text) is None and by_hand_reason(c.text) is None]
    assert not unlisted, ("documented commands neither exercised by this test nor listed in RUN_BY_HAND (add the "
                          "reason there, or teach exercise() the command):\n" + "\n".join(unlisted))
    unused = [p for p in RUN_BY_HAND if not any(re.fullmatch(p, c.text) for c in COMMANDS)]
    assert not unused, f"RUN_BY_HAND entries that no documented command matches any more: {unused}"
    # What is not run here still names what exists: make targets of the Makefile.
    targets = set(re.findall(r"^([\w.-]+):", (ROOT / "Makefile").read_text(), re.MULTILINE))
    for c in COMMANDS:
        parsed = split_command(c.text)
        if parsed and parsed.argv[0] == "make":
            missing = [t for t in parsed.argv[1:] if not t.startswith("-") and "=" not in t and t not in targets]
            assert not missing, f"{c}: no Makefile target {missing}"


def test_every_doc_with_commands_yields_them():
    """The extractor finds what a reader sees: each file's ```bash blocks give commands, and the counts stay put."""
    for path in DOC_FILES:
        text = path.read_text()
        found = [c for c in COMMANDS if c.file == str(path.relative_to(ROOT))]
        if "```bash" in text:
            assert any(c.block == "bash" for c in found), f"{path}: ```bash blocks but no command extracted"
    assert len(EXERCISED) >= 40, len(EXERCISED)


# A wrong command in a copy of a doc must be reported: (doc, text there, the wrong text, what the report says).
BROKEN = [
    ("README.md", "--max-new-tokens 64", "--max-new-tokenz 64", "max-new-tokenz"),
    ("README.md", "srun python -m codegeex_train.pretrain --tensor-model-parallel-size 8",
     "srun python -m codegeex_train.pretrain --tensor-model-paralel-size 8", "tensor-model-paralel-size"),
    ("README.md", "DRY_RUN=1 TP=2 bash", "DRY_RUN=1 TP=3 bash", "TP 3"),
    ("README.md", "codegeex-13b TP=8 GLOBAL_BATCH=64", "codegeex-13b TP=8 GLOBAL_BATCH=60", "GLOBAL_BATCH 60"),
    ("docs/clusters.md", "pretrain_codegen.sh --decoder-last-pipeline-num-layers 9",
     "pretrain_codegen.sh --decoder-last-pipeline-num-layers 20", "decoder-last-pipeline-num-layers"),
    ("docs/clusters.md", "torchrun --nnodes 2", "torchrun --nodes-count 2", "--nodes-count"),
    ("docs/clusters.md", "deepspeed --no_ssh --node_rank K", "deepspeed --no_ssh --node_rank KK", "node_rank"),
    ("docs/planner.md", "--config codegeex-13b --tensor", "--config codegeex-14b --tensor", "codegeex-14b"),
    ("docs/checkpoints.md", "--vocab-size 50000 --output", "--vocab-size 5O000 --output", "5O000"),
    ("docs/generation-and-evaluation.md", "--k 1,10,100", "--k 1,10,x", "--k"),
    ("docs/figures.md", "-o tp1-vs-tp2.png", "-O tp1-vs-tp2.png", "-O"),
]


@pytest.mark.parametrize("doc, good, bad, reported", BROKEN, ids=[b[2] for b in BROKEN])
def test_a_wrong_documented_command_is_reported(doc, good, bad, reported, tmp_path):
    text = (ROOT / doc).read_text()
    assert good in text, f"{doc} no longer has {good!r}: update BROKEN"
    copy = tmp_path / "doc.md"
    copy.write_text(text.replace(good, bad, 1))
    broken = [c for c in extract(copy, doc) if bad.split()[-1] in c.text and bad.split()[0] in c.text]
    assert broken, f"the wrong command was not extracted from the copy of {doc}"
    (tmp_path / "run").mkdir()
    with pytest.raises(CommandError, match=re.escape(reported)):
        exercise(broken[0], tmp_path / "run")
    # And the right one passes, the same way.
    right = next(c for c in extract(ROOT / doc) if c.line == broken[0].line)
    (tmp_path / "run-right").mkdir()
    exercise(right, tmp_path / "run-right")


def test_an_unlisted_command_is_reported(tmp_path, monkeypatch):
    copy = tmp_path / "README.md"
    copy.write_text((ROOT / "README.md").read_text().replace("```bash\nmake pretrain   #",
                                                            "```bash\nscontrol ping\nmake pretrain   #", 1))
    monkeypatch.setattr(sys.modules[__name__], "COMMANDS", extract(copy, "README.md"))
    with pytest.raises(AssertionError, match=r"README\.md:\d+: scontrol ping"):
        test_every_other_command_is_listed_to_run_by_hand()
