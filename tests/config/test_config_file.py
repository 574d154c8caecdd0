"""Config files (config/config_file.py, configs/*.yaml): ``--config`` against the same flags on the command line, one
preset read alike by the pretraining parser, the script, the planner and the GPU check, the resolved config a run
writes and its checkpoints record, and the one-line errors."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from codegeex_train.accounting.planner import from_preset, preset_values
from codegeex_train.checkpoint.files import META_KEY, read_latest, shard_file
from codegeex_train.checkpoint.safe_load import safe_torch_load
from codegeex_train.config.arguments import parse_args
from codegeex_train.config.config_file import CONFIGS_DIR, dump_resolved, section
from tests.harness import metrics_records, run_distributed, run_pretrain, tiny_pretrain_args

ROOT = Path(__file__).resolve().parents[2]
PRESETS = sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml"))

# tiny_pretrain_args' values written by hand as a file (its own spelling: sections, a Megatron alias, a list, a
# --x/--no-x switch), with train_iters 5 that the command line's --train-iters 3 must override.
TINY_YAML = """\
model:
  num_layers: 2
  hidden_size: 32
  num_attention_heads: 4
  max_position_embeddings: 64
  hidden_dropout: 0
  attention_dropout: 0.0
train:
  seq-length: 32
  micro_batch_size: 2
  global_batch_size: 8
  train_iters: 5
  eval_interval: 1000
  eval_iters: 1
  seed: 7
optim:
  learning_rate: 2e-3
  lr_warmup_iters: 2
data:
  data_path: [{data}]
  split: 90,9,1
  num_workers: 0
logging:
  log_interval: 1
  progress_bar: false
"""


def _pretrain_each(topology, runs: list[list[str]]) -> None:
    """A rank's body: one ``pretrain.main`` after the other on the same process group (one spawn for both)."""
    for argv in runs:
        run_pretrain(topology, argv)


def test_config_file_run_equals_the_flags_and_is_recorded(tmp_path, tiny_data):
    """The same run from flags and from a file (plus a command-line override) gives bit-identical metrics; the file
    run's <save>/config.yaml and its checkpoint's metadata hold the resolved config, which rebuilds its Args."""
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY_YAML.format(data=tiny_data))
    by_flags, by_file = str(tmp_path / "flags"), str(tmp_path / "file")
    file_argv = ["--config", str(config), "--train-iters", "3", "--save", by_file]
    run_distributed(_pretrain_each, world_size=1, deadline_s=300,
                    runs=[tiny_pretrain_args(tiny_data, by_flags, 3), file_argv])
    a, b = metrics_records(by_flags), metrics_records(by_file)
    assert sorted(a) == sorted(b) == [1, 2, 3]  # the command line's --train-iters 3 won over the file's 5
    for it in a:
        for key in ("loss", "grad_norm", "lr"):
            assert b[it][key] == a[it][key], (it, key)  # exactly: the same Args, the same run
    resolved = Path(by_file, "config.yaml").read_text()
    assert parse_args(["--config", str(Path(by_file, "config.yaml"))]) == parse_args(file_argv)
    assert Path(by_flags, "config.yaml").is_file()  # every run with --save writes one
    meta = safe_torch_load(shard_file(by_file, read_latest(by_file), 0, 1, 0))[META_KEY]
    assert meta["resolved_config"] == resolved


def test_overrides_switches_lists_and_round_trip(tmp_path):
    """Command-line flags win over the file; true/false switches; a list; dump_resolved rebuilds any Args."""
    f = tmp_path / "c.yaml"
    f.write_text("model:\n  top_query_layer: false\n  num_layers: 6\ntrain:\n  bf16: true\n"
                 "  eval_humaneval_languages: [python, go]\ndata:\n  data_path: [1, a, 2, b]\n")
    args = parse_args(["--config", str(f)])
    assert (args.model.top_query_layer, args.model.num_layers, args.train.bf16) == (False, 6, True)
    assert args.train.eval_humaneval_languages == ["python", "go"] and args.data.data_path == ["1", "a", "2", "b"]
    args = parse_args([f"--config={f}", "--top-query-layer", "--num-layers", "3", "--data-path", "c"])
    assert (args.model.top_query_layer, args.model.num_layers, args.data.data_path) == (True, 3, ["c"])
    argv = ["--data-path", "x", "--lr", "1.5e-3", "--no-top-query-layer", "--fp16", "--no-load-optim", "--seed",
            "3", "--eval-humaneval-languages", "java", "--adam-eps", "1e-7", "--global-batch-size", "64"]
    expected = parse_args(argv)
    dumped = tmp_path / "resolved.yaml"
    dumped.write_text(dump_resolved(expected))
    assert parse_args(["--config", str(dumped)]) == expected
    assert parse_args(["--config", str(dumped)]) != parse_args(["--data-path", "x"])  # the check can fail


@pytest.mark.parametrize("text, message", [
    ("model:\n  num_layer: 4\n", "unknown key model.num_layer (did you mean model.num_layers?)"),
    ("train:\n  num_layers: 4\n", "unknown key train.num_layers (did you mean model.num_layers?)"),
    ("num_layers: 4\n", "unknown key 'num_layers' (did you mean model.num_layers?)"),
    ("modle:\n  num_layers: 4\n", "unknown key 'modle' (did you mean model?)"),
    ("model:\n  num_layers: four\n", "model.num_layers: invalid int value: 'four'"),
    ("model:\n  num_layers: 0\n", "model.num_layers 0 must be >= 1"),
    ("optim:\n  adam_beta1: 1.0\n", "optim.adam_beta1 1.0 must be in [0, 1)"),
    ("optim:\n  lr_decay_style: cosin\n", "optim.lr_decay_style: invalid choice: 'cosin'"),
    ("train:\n  fp16: 1\n", "train.fp16 must be true or false, not 1"),
    ("model:\n  num_layers: [1, 2]\n", "model.num_layers [1, 2]: expected one int value"),
    ("launch:\n  recompte: full\n", "unknown key launch.recompte"),
    ("model: [\n", "not valid YAML at line 2"),
    ("- 1\n", "expected sections"),
    # as strict as the command line (issue 43): a list item is a value, never a flag
    ('data:\n  data_path: [D, --unsafe-no-sandbox, --eval-humaneval-interval, "100"]\n',
     "data.data_path: --unsafe-no-sandbox would be read as a flag, not a value"),
    ("model:\n  num_layers: [4, --fp16]\n", "model.num_layers [4, --fp16]: expected one int value"),
    # YAML 1.1's readings that are not the word's: octal, sexagesimal, hex, underscores, yes/off
    ("train:\n  seq_length: 0100\n", "train.seq_length: 0100 is ambiguous: YAML 1.1 reads 64, the command line 100"),
    ("train:\n  micro_batch_size: 1:00\n", "train.micro_batch_size: 1:00 is ambiguous: YAML 1.1 reads 60"),
    ("train:\n  seed: 0x10\n", "train.seed: 0x10 is ambiguous: YAML 1.1 reads 16"),
    ("train:\n  train_iters: 1_000\n", "train.train_iters: 1_000 is ambiguous"),
    ("train:\n  fp16: yes\n", "train.fp16: yes is ambiguous: YAML 1.1 reads true"),
    ("data:\n  data_path: [a, off]\n", "data.data_path[1]: off is ambiguous"),
    # a key given twice: the same spelling, two spellings of one flag, a section twice
    ("model:\n  num_layers: 4\n  num_layers: 6\n", "model.num_layers is given twice (lines 2 and 3): keep one"),
    ("model:\n  num_layers: 4\n  num-layers: 6\n", "model.num_layers and model.num-layers both set --num-layers"),
    ("optim:\n  lr: 1.0e-3\n  learning_rate: 2.0e-3\n", "optim.lr and optim.learning_rate both set --lr"),
    ("model:\n  num_layers: 4\nmodel:\n  hidden_size: 8\n", "model is given twice (lines 1 and 3)"),
    # nesting, aliases and tags
    ("data:\n  data_path: " + "[" * 3000 + "]" * 3000 + "\n", "nested deeper than 8 levels at line 2"),
    ("data:\n  data_path: &a [D, *a]\n", "nested deeper than 8 levels (aliases expanded)"),
    ("a: &a [x, x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
     "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]\n"
     "e: [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]\n", "more than 10000 values (aliases expanded)"),
    ('model: !!python/object/apply:os.system ["true"]\n', "model: the tag !!python/object/apply:os.system at line 1"),
])
def test_mistakes_are_one_line_naming_file_and_key(tmp_path, capsys, text, message):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(SystemExit) as e:
        parse_args(["--config", str(f), "--data-path", "x"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith(f"error: --config {f}: "), err
    assert message in err, err


@pytest.mark.parametrize("argv, message", [
    (["--config", "missing.yaml"], "--config missing.yaml: no such file"),
    (["--config", "/dev/zero"], "--config /dev/zero: a character device, not a regular file"),
    (["--config"], "--config needs a file"),
    (["--config", "a.yaml", "--config=b.yaml"], "--config is given twice"),
])
def test_config_flag_mistakes(capsys, argv, message):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("raw, message", [
    (b"data:\n  data_path: [caf\xe9]\n", "not UTF-8 text (invalid continuation byte at byte 23)"),
    (b"model:\n  num_layers: \x00\x01\n", "not valid YAML: character #x0000 at line 2 is not allowed"),
    (b"# padding\n" * 110_000, "larger than 1 MiB, the bound on this file: refused"),
])
def test_bytes_that_are_no_config_are_one_line(tmp_path, capsys, raw, message):
    """Latin-1, binary and oversized files (read at most 1 MiB + 1 byte): one line, never a traceback."""
    f = tmp_path / "bad.yaml"
    f.write_bytes(raw)
    with pytest.raises(SystemExit) as e:
        parse_args(["--config", str(f)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == f"error: --config {f}: {message}\n"


def test_a_stray_word_after_the_file_is_refused(tmp_path, capsys):
    """The file's flags go in front of the command line's: a stray first word would be one more value of the file's
    last list flag. It is refused as the command line alone refuses it."""
    f = tmp_path / "c.yaml"
    f.write_text("data:\n  data_path: [a]\n")
    with pytest.raises(SystemExit):
        parse_args(["--config", str(f), "b"])
    assert capsys.readouterr().err == "error: unexpected value b (every input is a --flag VALUE)\n"
    assert parse_args(["--config", str(f), "--data-path", "b"]).data.data_path == ["b"]


def test_yaml_1_2_readings_the_same_as_the_command_line(tmp_path):
    """What a file may write, read as the same words on the command line: decimal numbers (leading zeros where YAML
    1.1 agrees), exponents without a dot, quoted text, a byte-order mark, null for a switch (its default)."""
    f = tmp_path / "c.yaml"
    f.write_bytes("\ufeffmodel:\n  num_layers: 007\n  top_query_layer: null\ntrain:\n  seed: +5\n  fp16: TRUE\n"
                  "optim:\n  lr: 2e-3\ndata:\n  data_path: ['0100', \"1:00\", yes-no, 1e3]\n".encode())
    args = parse_args(["--config", str(f)])
    assert args == parse_args(["--num-layers", "007", "--seed", "+5", "--fp16", "--lr", "2e-3", "--data-path",
                               "0100", "1:00", "yes-no", "1e3"])
    assert args.data.data_path == ["0100", "1:00", "yes-no", "1e3"] and args.model.top_query_layer is True
    assert section(str(f), "optim") == {"lr": 0.002}  # the planner's reading: YAML 1.2's float (1.1's was text)


class Script:
    """scripts/pretrain_codegen.sh with DRY_RUN=1 on the CPU, in an empty directory; a `$PYTHON` that runs the
    script's config reader (`-m codegeex_train.config.script_values`) and passes anything else stands in for
    pretrain.py's own dry-run checks, so only the script's reading of the preset is exercised here."""

    def __init__(self, tmp_path: Path):
        self.cwd = tmp_path / "cwd"
        self.cwd.mkdir(exist_ok=True)
        self.python = tmp_path / "python"
        self.python.write_text(f'#!/bin/sh\n[ "$1" = -m ] && exec {sys.executable} "$@"\nexit 0\n')
        self.python.chmod(0o755)

    def argv(self, config: str, **variables: str) -> list[str]:
        keep = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG")}
        env = {**keep, "DRY_RUN": "1", "DEVICE": "cpu", "PYTHON": str(self.python), "CONFIG": config, **variables}
        proc = subprocess.run(["bash", str(ROOT / "scripts" / "pretrain_codegen.sh")], cwd=self.cwd, env=env,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.splitlines()[-1].split()


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def launched(argv: list[str]):
    """What pretrain.py makes of the launch command's own arguments (from --config on)."""
    return parse_args(argv[argv.index("--config"):])


@pytest.mark.parametrize("preset", PRESETS)
def test_the_script_reads_each_preset_as_pretrain_does(tmp_path, preset):
    """What the script launches keeps every value of the preset: it adds its own only where the file sets none."""
    argv = Script(tmp_path).argv(preset)
    assert flag(argv, "--config") == str(CONFIGS_DIR / f"{preset}.yaml")
    args = launched(argv)  # the launch command's pretrain part
    expected = parse_args(["--config", str(CONFIGS_DIR / f"{preset}.yaml")])
    for name in ("seq_length", "train_iters", "micro_batch_size", "eval_interval", "save_interval"):
        assert getattr(args.train, name) == getattr(expected.train, name), name
    assert args.model == expected.model and args.optim == expected.optim
    assert args.logging.log_interval == expected.logging.log_interval
    if expected.train.global_batch_size is not None:
        assert args.train.global_batch_size == expected.train.global_batch_size


def test_one_preset_file_three_readers(tmp_path):
    """A value changed in a copy of a preset reaches the script, the planner and the GPU check (and pretrain.py)."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.gpu import parse as gpu_check_args

    original = CONFIGS_DIR / "codegeex-1.3b.yaml"
    copy = tmp_path / "mine.yaml"
    copy.write_text(original.read_text().replace("  seq_length: 2048\n", "  seq_length: 1024\n", 1))
    script = Script(tmp_path)
    for path, seq in ((str(original), 2048), (str(copy), 1024)):
        assert launched(script.argv(path)).train.seq_length == seq
        assert preset_values(path)["seq_length"] == seq  # what the planner's --config reads
        assert gpu_check_args(["--config", path]).c_seq_length == seq
        assert parse_args(["--config", path]).train.seq_length == seq


def test_codegeex_13b_global_batch_agrees_everywhere(tmp_path):
    """CodeGeeX-13B's published global batch (3,072) in the file, the script and the planner."""
    published = yaml.safe_load((CONFIGS_DIR / "codegeex-13b.yaml").read_text())["train"]["global_batch_size"]
    assert published == 3072
    assert launched(Script(tmp_path).argv("codegeex-13b")).train.global_batch_size == 3072
    assert from_preset("codegeex-13b")[2]["global_batch_size"] == 3072
    assert flag(Script(tmp_path).argv("codegeex-13b", GLOBAL_BATCH="1536"), "--global-batch-size") == "1536"
