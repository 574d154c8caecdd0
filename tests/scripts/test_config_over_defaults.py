"""The script's defaults never override a config file (issue 43, case 3): `CONFIG=RUN/config.yaml bash
scripts/pretrain_codegen.sh` launches the run that file describes, its data, tokenizer, layout, DeepSpeed config,
precision and directory; a variable the user sets still wins; the dry run checks the data the launch would use.

The script runs with DRY_RUN=1 and the fake `$PYTHON` of tests/scripts/test_pretrain_script.py (which records
pretrain.py's check and runs the script's config reader for real); what pretrain.py makes of the launch command is
parsed here (`parse_args`, the code every rank runs first).
"""

from __future__ import annotations

import dataclasses
import shutil

import pytest

from codegeex_train.config.arguments import parse_args
from codegeex_train.config.config_file import write_resolved
from tests.scripts.test_pretrain_script import ROOT, Script, dry_run

PRETRAIN = f"{ROOT}/codegeex_train/pretrain.py"
TOKENIZER_JSON = ROOT / "codegeex_train" / "tokenization" / "assets" / "default_tokenizer.json"


@pytest.fixture
def script(tmp_path) -> Script:
    return Script(tmp_path)


def launched(argv: list[str]):
    """pretrain.py's Args for the launch command's own arguments."""
    return parse_args(argv[argv.index(PRETRAIN) + 1:])


def sections(args) -> dict:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}


def script_flags(argv: list[str]) -> list[str]:
    """The flags the script itself put after --config FILE (the arguments given to it come last)."""
    return [w for w in argv[argv.index("--config") + 2:] if w.startswith("--")]


@pytest.fixture
def run_config(request, script, tiny_data):
    """A run's own RUN/config.yaml as pretrain.py writes it at the start of a launch of the script with its own data,
    tokenizer, DeepSpeed config, layout (TP 2, or the request's), schedule and FIM: that launch's arguments, resolved."""
    tp = getattr(request, "param", "2")
    run = script.tmp / "run"
    shutil.copy(TOKENIZER_JSON, script.tmp / "tok.json")
    (script.tmp / "ds.json").write_text('{"zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": true}')
    variables = dict(OUTPUT_DIR=str(run), TP=tp, SEQ_LENGTH="128", MICRO_BATCH="2", TRAIN_ITERS="7", LR="3e-4",
                     WARMUP="2", DATA_PATH=tiny_data, DS_CONFIG=str(script.tmp / "ds.json"), FIM_RATE="0.25",
                     TOKENIZER_ARGS=f"--tokenizer-type HFTokenizer --tokenizer-model {script.tmp / 'tok.json'}")
    _, _, argv = dry_run(script, "--num-attention-heads", "4", **variables)
    original = launched(argv)
    write_resolved(original, str(run))
    return run / "config.yaml", original


@pytest.mark.parametrize("run_config", ["1", "2"], indirect=True, ids=["tp1", "tp2"])
def test_a_runs_own_config_launches_that_run(script, run_config, tiny_data):
    """Every value of the relaunch is the run's: nothing of the script's defaults (the stdlib corpus, TP 1, its
    DeepSpeed config, ./outputs/codegen-config) replaces one; and the dry run's check gets the same data."""
    config, original = run_config
    layout, _, argv = dry_run(script, CONFIG=str(config))
    assert sections(launched(argv)) == sections(original)
    tp = original.parallel.tensor_model_parallel_size
    assert (layout["TP"], layout["SEQ_LENGTH"], layout["MICRO_BATCH"]) == (str(tp), "128", "2")
    # pretrain.py's check ran on those arguments, the data files included (dry_run compares them): no corpus to
    # preprocess first, no skipped data check.
    check = (script.tmp / "calls.check").read_bytes().decode().split("\0")[:-1]
    assert "--dry-run-skip-data" not in check and launched(check).data.data_path == [tiny_data]
    assert not any(w in script_flags(argv) for w in ("--data-path", "--tokenizer-model", "--deepspeed-config",
                                                      "--tensor-model-parallel-size", "--save"))


def test_the_users_variables_still_win_over_the_file(script, run_config, tmp_path):
    config, original = run_config
    other = tmp_path / "elsewhere"
    _, _, argv = dry_run(script, CONFIG=str(config), TP="1", GLOBAL_BATCH="4", TRAIN_ITERS="14", LR="1e-4",
                         DATA_PATH="other/data", DS_CONFIG=str(tmp_path / "ds.json"), OUTPUT_DIR=str(other),
                         FIM_RATE="0")
    args = launched(argv)
    assert (args.parallel.tensor_model_parallel_size, args.train.global_batch_size) == (1, 4)
    assert (args.train.train_iters, args.optim.lr) == (14, 1e-4)
    assert args.data.data_path == ["other/data"] and args.train.save == str(other) and args.data.fim_rate == 0
    # the rest is still the file's
    assert args.model == original.model and args.data.tokenizer_model == original.data.tokenizer_model
    assert args.optim.lr_warmup_iters == 2 and args.train.seq_length == 128


def test_yaml_forms_the_file_may_use_are_read_as_pretrain_reads_them(script, tmp_path, tiny_data):
    """Flow mappings, quoted numbers, block lists, comments: the layout the script computes and checks is the one
    pretrain.py gets, and no value of the file is replaced by a default of the script."""
    preset = tmp_path / "mine.yaml"
    preset.write_text(
        "model: {num_layers: 4, hidden_size: 64, num_attention_heads: 4, max_position_embeddings: 128}\n"
        "parallel: {tensor_model_parallel_size: 2}   # TP 2 on the 2 CPU ranks\n"
        "train:\n  seq_length: '128'\n  micro_batch_size: 2\n  global_batch_size: 8\n  train_iters: 5\n"
        "  deepspeed_config: " + str(ROOT / "ds_configs" / "cpu_fp32_zero2.json") + "\n"
        "data:\n  data_path:\n    - " + tiny_data + "\n")
    layout, _, argv = dry_run(script, CONFIG=str(preset))
    args, expected = launched(argv), parse_args(["--config", str(preset)])
    assert (layout["TP"], layout["DP"], layout["SEQ_LENGTH"], layout["MICRO_BATCHES"]) == ("2", "1", "128", "4")
    # What the file sets none of, the script's defaults fill in: the output directory and the device's backend.
    expected = dataclasses.replace(
        expected, train=dataclasses.replace(expected.train, save="./outputs/codegen-mine"),
        parallel=dataclasses.replace(expected.parallel, distributed_backend="gloo"))
    assert sections(args) == sections(expected)


def test_a_fine_tuning_runs_config_resumes_its_run(script, run_config, tmp_path):
    """A fine-tuning's config (load: the source, finetune: true): relaunched once RUN holds a checkpoint, the script
    adds no --load of its own (pretrain.py refuses --finetune with --load equal to --save, and under --finetune
    resumes --save's checkpoint itself)."""
    config, original = run_config
    source = tmp_path / "released"
    source.mkdir()
    tuned = dataclasses.replace(original, train=dataclasses.replace(original.train, load=str(source), finetune=True))
    write_resolved(tuned, str(config.parent))
    (config.parent / "latest").write_text("iter_0000004")
    _, _, argv = dry_run(script, CONFIG=str(config))
    args = launched(argv)
    assert args.train.load == str(source) and args.train.finetune and args.train.save == original.train.save
    assert "--load" not in script_flags(argv)


def one_error_line(proc) -> str:
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


def test_a_runs_config_from_another_directory_is_refused_not_started_elsewhere(script, run_config, tmp_path):
    """RUN/config.yaml holds `save:` as that run was given it; from another working directory a relative one would
    name another directory: refused (OUTPUT_DIR decides), never a new run beside the old one."""
    config, original = run_config
    run = config.parent
    (run / "latest").write_text("iter_0000004")
    text = config.read_text().replace(f"save: {run}", "save: run")
    assert text != config.read_text()
    config.write_text(text)  # as a launch from tmp_path with OUTPUT_DIR=run writes it
    script.calls.unlink()  # (the fixture's dry run)
    line = one_error_line(script.run(CONFIG=str(config)))
    assert f"is the config of the run in {run}" in line and f"OUTPUT_DIR={run}" in line
    assert script.launched() == []
    _, _, argv = dry_run(script, CONFIG=str(config), OUTPUT_DIR=str(run))
    assert launched(argv).train.save == str(run) and argv[-2:] == ["--load", str(run)]


@pytest.mark.parametrize("text, variables, named", [
    ("data: {tokenizer_type: HFTokenizer, tokenizer_model: tok.json}\n", {},
     "sets a tokenizer (tokenizer_type: HFTokenizer, tokenizer_model: tok.json) but no data_path"),
    ("parallel: {sequence_parallel: true}\n", {"SP": "0"}, "SP=0, but CONFIG="),
    ("train: {recompute_granularity: selective}\n", {"RECOMPUTE": "none"},
     "sets recompute_granularity: selective, which the command line cannot undo"),
    ("train: {checkpoint_activations: true}\n", {"RECOMPUTE": "selective"}, "sets checkpoint_activations: true"),
    ("parallel: {distributed_backend: nccl}\n", {}, "sets distributed_backend: nccl, which needs GPU ranks"),
    ("train: {micro_batch_size: 0100}\n", {}, "train.micro_batch_size: 0100"),  # the reader's own refusal
    ("train: {save: /runs/<redacted>/r1}\n", {}, "save: /runs/<redacted>/r1 had a credential redacted"),
])
def test_what_the_file_sets_and_a_variable_cannot_undo_is_one_line(script, tmp_path, text, variables, named):
    preset = tmp_path / "mine.yaml"
    preset.write_text(_merged(text))
    proc = script.run(CONFIG=str(preset), DEVICE="cpu", **variables)
    assert named in one_error_line(proc) and script.launched() == [] and list(script.cwd.iterdir()) == []


def _merged(text: str) -> str:
    """configs/default.yaml with the settings of ``text`` (a section and one flow mapping) written into that
    section as they are written there (their words kept)."""
    section, _, values = text.partition(":")
    extra = [f"  {item.strip()}" for item in values.strip().strip("{}").split(",")]
    keys = {item.partition(":")[0] for item in extra}
    lines = [line for line in (ROOT / "configs" / "default.yaml").read_text().splitlines()
             if line.partition(":")[0] not in keys]
    at = lines.index(f"{section}:") + 1 if f"{section}:" in lines else len(lines)
    return "\n".join(lines[:at] + [f"{section}:"] * (at == len(lines)) + extra + lines[at:]) + "\n"
