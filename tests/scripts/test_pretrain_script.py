"""scripts/pretrain_codegen.sh's layout, launch command and weights source, checked without training.

`DRY_RUN=1` prints the resolved layout and the exact launch command and launches nothing. The GPU branch is checked on
this CPU machine with a fake `nvidia-smi` first on PATH (the script counts the `GPU N: ...` lines of
`nvidia-smi -L`); every PATH entry holding a real one is left out, so the CPU cases see none. A fake `deepspeed` and
a fake `$PYTHON` record any call: a dry run makes one, pretrain.py's own checks (`--dry-run`, with the launch's
arguments at its ranks; tests/scripts/test_dry_run.py runs them for real), a refused layout none, and neither may
create anything in its (empty, temporary) working directory. One case runs the script for real with the fake
launcher, so the command the dry run prints is checked against the one that runs.
"""

import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "pretrain_codegen.sh"
# The script reads its CONFIG file with the package's own reader (`$PYTHON -m codegeex_train.config.script_values`):
# a fake `$PYTHON` hands that call to this interpreter, unrecorded (it runs nothing and writes nothing).
READER = f'[ "$1 $2" = "-m codegeex_train.config.script_values" ] && exec {shlex.quote(sys.executable)} "$@"\n'

# Variables of the outer environment that the script reads: a test sets the ones it wants.
SCRIPT_VARS = ("OUTPUT_DIR", "CONFIG", "DEVICE", "NUM_GPUS", "HOSTFILE", "TP", "PP", "MICRO_BATCH", "MICRO_BATCHES",
               "GLOBAL_BATCH", "TRAIN_ITERS", "SEQ_LENGTH", "DATA_PATH", "TOKENIZER_ARGS", "DS_CONFIG", "LR", "MIN_LR",
               "DECAY", "WARMUP", "LAUNCHER_ARGS", "INIT_FROM", "DRY_RUN", "DS_ACCELERATOR", "DS_ENV_FILE",
               "OMP_NUM_THREADS", "TORCH_EXTENSIONS_DIR", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "SP",
               "RECOMPUTE", "VPP", "PYTHONPATH", "FIM_RATE", "FIM_SPM_RATE", "DOCUMENT_LEVEL")

# What the script runs for the default CPU configuration: the preset file (configs/default.yaml: the model and the
# hyper-parameters the script used to spell out, equal values) and the values its layout arithmetic derives.
CPU_DEFAULT_ENV = {"PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
                   "TORCH_EXTENSIONS_DIR": f"{ROOT}/.cache/torch_extensions",
                   "MALLOC_MMAP_THRESHOLD_": "4194304", "MALLOC_TRIM_THRESHOLD_": "4194304"}


def cpu_default_argv(output_dir="./outputs/codegen-default"):
    return ["deepspeed", "--num_gpus", "2", f"{ROOT}/codegeex_train/pretrain.py",
            "--config", f"{ROOT}/configs/default.yaml",
            "--distributed-backend", "gloo", "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size",
            "1", "--global-batch-size", "16",
            "--data-path", f"{ROOT}/.cache/data/stdlib_text_document",
            "--deepspeed-config", f"{ROOT}/ds_configs/cpu_fp32_zero2.json",
            "--save", output_dir]


def _executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


class Script:
    """Runs the script in an empty working directory with fake `deepspeed`, `$PYTHON` and (optionally) `nvidia-smi`."""

    def __init__(self, tmp_path: Path):
        self.tmp = tmp_path
        self.cwd = tmp_path / "cwd"
        self.cwd.mkdir()
        self.bin = tmp_path / "bin"
        self.bin.mkdir()
        self.calls = tmp_path / "calls"  # one line per fake launcher / python call
        # The fake launcher records its argv and environment (NUL-separated) and exits 0.
        _executable(self.bin / "deepspeed", '#!/bin/sh\necho deepspeed >> "$FAKE_CALLS"\n'
                                            'printf "%s\\0" "$@" > "$FAKE_CALLS.argv"\nenv -0 > "$FAKE_CALLS.env"\n')
        # The fake python passes pretrain.py's dry-run checks (recording argv and WORLD_SIZE) and fails anything else.
        _executable(self.bin / "fake-python",
                    '#!/bin/sh\n' + READER + 'echo "python $*" >> "$FAKE_CALLS"\ncase " $* " in *" --dry-run "*)\n'
                    '  printf "%s\\0" "$@" > "$FAKE_CALLS.check"; echo "$WORLD_SIZE" > "$FAKE_CALLS.world"; exit 0 ;;\n'
                    'esac\nexit 1\n')
        # Every PATH entry but those holding a real nvidia-smi (the tools the script uses: awk, grep, date, ...).
        self.system_path = [d for d in os.environ.get("PATH", os.defpath).split(os.pathsep)
                            if d and not (Path(d) / "nvidia-smi").exists()]

    def fake_gpus(self, count: int) -> None:
        lines = "".join(f"echo 'GPU {i}: NVIDIA H200 (UUID: GPU-{i:08x}-1111-2222-3333-444444444444)'\n"
                        for i in range(count))
        _executable(self.bin / "nvidia-smi", f'#!/bin/sh\n[ "$1" = -L ] || exit 1\n{lines}')

    def run(self, *args: str, dry: bool = True, **variables: str) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if k not in SCRIPT_VARS}
        env.update(PATH=os.pathsep.join([str(self.bin), *self.system_path]), PYTHON=str(self.bin / "fake-python"),
                   FAKE_CALLS=str(self.calls), **variables)
        if dry:
            env["DRY_RUN"] = "1"
        return subprocess.run(["bash", str(SCRIPT), *args], check=False, cwd=self.cwd, env=env, capture_output=True,
                              text=True, timeout=60)

    def launched(self) -> list:
        return self.calls.read_text().splitlines() if self.calls.exists() else []


@pytest.fixture
def script(tmp_path) -> Script:
    return Script(tmp_path)


def dry_run(script: Script, *args: str, **variables: str):
    """(layout, environment assignments, argv) of a dry run that must succeed, run nothing and write nothing."""
    script.calls.unlink(missing_ok=True)  # (an earlier dry run's checks)
    proc = script.run(*args, **variables)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(script.launched()) == 1 and script.launched()[0].startswith("python "), "a dry run ran something"
    assert list(script.cwd.iterdir()) == [], "a dry run created files"
    lines = proc.stdout.splitlines()
    layout_line = next(line for line in lines if line.startswith("codegeex_train: layout "))
    layout = dict(word.split("=", 1) for word in layout_line.split()[2:])
    marker = next(i for i, line in enumerate(lines) if "The launch command (one line):" in line)
    assert marker == len(lines) - 2, "the command is the last line"
    words = shlex.split(lines[-1])
    split = next(i for i, word in enumerate(words) if "=" not in word)
    env = dict(word.split("=", 1) for word in words[:split])
    argv = words[split:]
    # pretrain.py's checks saw the launch's own arguments, at its ranks (and no data while the corpus is unbuilt).
    check = (script.tmp / "calls.check").read_bytes().decode().split("\0")[:-1]
    unbuilt = ["--dry-run-skip-data"] if any("first preprocesses" in line for line in lines) else []
    assert check == argv[argv.index(f"{ROOT}/codegeex_train/pretrain.py"):] + ["--dry-run", *unbuilt]
    assert (script.tmp / "calls.world").read_text().strip() == layout["RANKS"]
    return layout, env, argv


def flag(argv: list, name: str) -> str:
    """The value pretrain.py gets for ``name`` (its last occurrence wins)."""
    return argv[len(argv) - 1 - argv[::-1].index(name) + 1]


def launched_args(argv: list):
    """What pretrain.py makes of the launch command's own arguments (the --config file's values included)."""
    from codegeex_train.config.arguments import parse_args

    return parse_args(argv[argv.index(f"{ROOT}/codegeex_train/pretrain.py") + 1:])


def check_batch(layout: dict, argv: list) -> None:
    micro, dp, global_batch = int(layout["MICRO_BATCH"]), int(layout["DP"]), int(layout["GLOBAL_BATCH"])
    assert global_batch == micro * dp * int(layout["MICRO_BATCHES"])
    assert int(layout["RANKS"]) == dp * int(layout["TP"]) * int(layout.get("CP", 1)) * int(layout["PP"])
    train = launched_args(argv).train  # the layout shown is the one pretrain.py gets
    assert train.global_batch_size == global_batch and global_batch % (micro * dp) == 0
    assert train.micro_batch_size == micro


def test_one_gpu_runs_bf16_nccl_with_the_accelerator_left_to_deepspeed(script):
    script.fake_gpus(1)
    layout, env, argv = dry_run(script)
    assert layout["DEVICE"] == "gpu" and layout["RANKS"] == "1" and layout["DP"] == "1"
    assert "DS_ACCELERATOR" not in env and env == {"PYTHONPATH": str(ROOT)}
    assert not any("DS_ACCELERATOR" in word for word in argv)
    assert argv[:3] == ["deepspeed", "--num_gpus", "1"]
    assert flag(argv, "--distributed-backend") == "nccl" and "--bf16" in argv and "--fp16" not in argv
    assert flag(argv, "--deepspeed-config") == f"{ROOT}/ds_configs/gpu_bf16_zero2.json"
    check_batch(layout, argv)
    assert layout["GLOBAL_BATCH"] == "8"


def test_eight_gpus_give_dp_8_and_a_global_batch_that_follows(script):
    script.fake_gpus(8)
    layout, env, argv = dry_run(script)
    assert (layout["DEVICE"], layout["NODES"], layout["RANKS"], layout["TP"], layout["PP"], layout["DP"]) == \
        ("gpu", "1", "8", "1", "1", "8")
    assert layout["GLOBAL_BATCH"] == str(8 * 8 * 1) and layout["MICRO_BATCHES"] == "1"
    assert argv[:3] == ["deepspeed", "--num_gpus", "8"] and env == {"PYTHONPATH": str(ROOT)}
    assert flag(argv, "--distributed-backend") == "nccl" and "--bf16" in argv
    check_batch(layout, argv)


def test_two_nodes_from_a_hostfile_13b_tp8_pp2(script):
    script.fake_gpus(8)
    hostfile = script.tmp / "hostfile"
    hostfile.write_text("# two nodes\nnode1 slots=8\n\nnode2 slots=8\n")
    layout, env, argv = dry_run(script, HOSTFILE=str(hostfile), CONFIG="codegeex-13b", TP="8", PP="2")
    assert (layout["CONFIG"], layout["DEVICE"], layout["NODES"], layout["RANKS"], layout["DP"]) == \
        ("codegeex-13b", "gpu", "2", "16", "1")
    assert layout["GLOBAL_BATCH"] == "3072" and layout["MICRO_BATCH"] == "8" and layout["MICRO_BATCHES"] == "384"
    check_batch(layout, argv)
    assert argv[:3] == ["deepspeed", "--hostfile", str(hostfile)] and "--num_gpus" not in argv
    assert flag(argv, "--tensor-model-parallel-size") == "8" and flag(argv, "--pipeline-model-parallel-size") == "2"
    assert flag(argv, "--config") == f"{ROOT}/configs/codegeex-13b.yaml" and flag(argv, "--distributed-backend") == "nccl" and "--bf16" in argv
    assert flag(argv, "--save") == "./outputs/codegen-codegeex-13b"
    # The other nodes' variables travel in OUTPUT_DIR/.deepspeed_env (written by a real run, not by a dry one).
    assert env == {"PYTHONPATH": str(ROOT),
                   "DS_ENV_FILE": f"{script.cwd.resolve()}/outputs/codegen-codegeex-13b/.deepspeed_env"}


def test_cpu_default_command_is_unchanged(script):
    layout, env, argv = dry_run(script)
    assert (layout["DEVICE"], layout["RANKS"], layout["DP"], layout["GLOBAL_BATCH"]) == ("cpu", "2", "2", "16")
    assert env == CPU_DEFAULT_ENV
    assert argv == cpu_default_argv()


def pretrain_args(argv: list, ranks: str):
    """What pretrain.py makes of the launch command's own arguments: parsed, and their plan at ``ranks``."""
    from codegeex_train.config.arguments import parse_args, validate

    args = parse_args(argv[argv.index(f"{ROOT}/codegeex_train/pretrain.py") + 1:])
    return args, validate(args, int(ranks))


def test_sp_and_selective_recompute_go_into_the_command(script):
    layout, env, argv = dry_run(script, TP="2", SP="1", RECOMPUTE="selective")
    assert (layout["SP"], layout["RECOMPUTE"], layout["TP"]) == ("1", "selective", "2")
    assert argv.count("--sequence-parallel") == 1 and flag(argv, "--recompute-granularity") == "selective"
    assert "--checkpoint-activations" not in argv and env == CPU_DEFAULT_ENV
    args, plan = pretrain_args(argv, layout["RANKS"])
    assert args.parallel.sequence_parallel and plan.recompute.describe() == "selective (core_attn)"
    # Nothing else changes: the default command with the two flags after the layout's.
    layout, _, argv = dry_run(script, SP="1", RECOMPUTE="full")
    assert (layout["SP"], layout["RECOMPUTE"]) == ("1", "full")
    default = cpu_default_argv()
    at = default.index("--pipeline-model-parallel-size") + 2
    assert argv == default[:at] + ["--sequence-parallel", "--recompute-granularity", "full"] + default[at:]


def test_sp_with_tp_1_is_passed_on_and_pretrain_warns(script):
    """As in Megatron: SP at TP 1 is no error, pretrain.py warns that it does nothing."""
    layout, _, argv = dry_run(script, SP="1")
    assert (layout["TP"], layout["SP"], layout["RECOMPUTE"]) == ("1", "1", "none") and "--sequence-parallel" in argv
    assert "--recompute-granularity" not in argv
    with pytest.warns(UserWarning, match="--sequence-parallel with --tensor-model-parallel-size 1 does nothing"):
        pretrain_args(argv, layout["RANKS"])


def test_default_cpu_layout_line_shows_no_sp_and_no_recompute(script):
    layout, _, argv = dry_run(script, RECOMPUTE="none", SP="0")
    assert (layout["SP"], layout["RECOMPUTE"]) == ("0", "none") and argv == cpu_default_argv()


def test_vpp_interleaves_the_pipeline(script):
    """VPP=N is --num-layers-per-virtual-pipeline-stage N, right after the pipeline size; the layout line shows it."""
    from codegeex_train.config.arguments import parse_args, validate

    layout, _, argv = dry_run(script, PP="2", VPP="1")
    assert (layout["PP"], layout["VPP"], layout["MICRO_BATCHES"]) == ("2", "1", "2")
    default = cpu_default_argv()
    at = default.index("--pipeline-model-parallel-size") + 1
    assert argv == default[:at] + ["2", "--num-layers-per-virtual-pipeline-stage", "1"] + default[at + 1:]
    parsed = parse_args(argv[argv.index(f"{ROOT}/codegeex_train/pretrain.py") + 1:])
    assert validate(parsed, int(layout["RANKS"])).num_chunks == 2  # 4 layers, 2 stages, chunks of 1 layer
    # the arguments' flag wins, and is the one checked and shown
    layout, _, argv = dry_run(script, "--num-layers-per-virtual-pipeline-stage=1", PP="2", VPP="3")
    assert layout["VPP"] == "1" and [w for w in argv if "virtual" in w] == ["--num-layers-per-virtual-pipeline-stage=1"]
    assert dry_run(script)[0]["VPP"] == "none"


def test_cp_splits_the_sequence_and_the_layout_line_shows_it(script):
    """CP=N is --context-parallel-size N after the layout's other flags; DP counts CP out; the arguments' flag wins."""
    from codegeex_train.config.arguments import parse_args, validate

    script.fake_gpus(8)
    layout, _, argv = dry_run(script, "--position-embedding-type", "rope", "--max-position-embeddings", "1024",
                              DEVICE="gpu", TP="2", CP="2", SEQ_LENGTH="1024")
    assert (layout["TP"], layout["CP"], layout["DP"], layout["SEQ_LENGTH"]) == ("2", "2", "2", "1024")
    assert flag(argv, "--context-parallel-size") == "2" and flag(argv, "--seq-length") == "1024"
    check_batch(layout, argv)
    plan = validate(parse_args(argv[argv.index(f"{ROOT}/codegeex_train/pretrain.py") + 1:]), 8)
    assert (plan.tp_size, plan.cp_size, plan.dp_size, plan.local_seq_length) == (2, 2, 2, 512)
    layout, _, argv = dry_run(script, "--context-parallel-size=4", CP="2")
    assert layout["CP"] == "4" and "--context-parallel-size" not in argv
    assert dry_run(script)[0]["CP"] == "1" and "--context-parallel-size" not in dry_run(script)[2]


@pytest.mark.parametrize("tp, variables, args, sp, recompute", [
    ("8", {}, (), True, "selective"),  # Megatron's choice for TP 8: SP + selective, not full recompute
    ("1", {}, (), False, "selective"),  # no SP at TP 1: its default follows TP
    ("8", {"SP": "0", "RECOMPUTE": "full"}, (), False, "full"),
    ("8", {"RECOMPUTE": "none"}, (), True, "none"),
    ("8", {}, ("--checkpoint-activations",), True, "full"),  # the arguments win; no clash with selective
    ("8", {"RECOMPUTE": "full"}, ("--recompute-granularity=selective",), True, "selective"),
    ("1", {}, ("--tensor-model-parallel-size", "4"), True, "selective"),
])
def test_13b_memory_defaults_and_overrides(script, tp, variables, args, sp, recompute):
    script.fake_gpus(8)
    layout, _, argv = dry_run(script, *args, CONFIG="codegeex-13b", TP=tp, **variables)
    assert (layout["SP"], layout["RECOMPUTE"]) == (str(int(sp)), recompute)
    parsed, plan = pretrain_args(argv + ["--data-path", "x"], layout["RANKS"])  # the 13B config needs DATA_PATH's data
    assert parsed.parallel.sequence_parallel == sp
    assert (plan.recompute.granularity or "none") == recompute
    assert argv.count("--sequence-parallel") <= 1
    recompute_flags = [w for w in argv if w.split("=")[0] in ("--recompute-granularity", "--checkpoint-activations")]
    assert len(recompute_flags) == (recompute != "none")  # one, from the script or the arguments


def test_dry_run_prints_what_a_real_run_launches(script):
    """The real path, with the fake launcher: the same argv and environment as the dry run printed."""
    out, data = script.tmp / "out", str(script.tmp / "data" / "code_text_document")  # the fake never reads it
    _, env, argv = dry_run(script, OUTPUT_DIR=str(out), DATA_PATH=data)
    script.calls.unlink()  # (the dry run's checks)
    proc = script.run(dry=False, OUTPUT_DIR=str(out), DATA_PATH=data)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert script.launched()[0] == "deepspeed"  # then plotting (the fake python, which fails: only a warning)
    ran = (script.calls.parent / "calls.argv").read_bytes().decode().split("\0")[:-1]
    assert ["deepspeed", *ran] == argv
    ran_env = dict(item.split("=", 1) for item in
                   (script.calls.parent / "calls.env").read_bytes().decode().split("\0")[:-1])
    assert {k: ran_env.get(k) for k in env} == env
    assert (out / "logs").is_dir() and "codegeex_train: finished" in proc.stdout


def test_init_from_fine_tunes_until_output_dir_holds_a_checkpoint(script):
    init, out = script.tmp / "released-13b", script.tmp / "run"
    init.mkdir()
    _, _, argv = dry_run(script, "--seed", "3", INIT_FROM=str(init), OUTPUT_DIR=str(out))
    assert argv[-5:] == ["--load", str(init), "--finetune", "--seed", "3"]
    out.mkdir()
    (out / "latest").write_text("iter_0000100")
    _, _, argv = dry_run(script, INIT_FROM=str(init), OUTPUT_DIR=str(out))
    assert argv[-2:] == ["--load", str(out)] and "--finetune" not in argv and argv.count("--load") == 1
    _, _, argv = dry_run(script)  # no INIT_FROM, no checkpoint: from scratch
    assert "--load" not in argv and "--finetune" not in argv


def test_a_load_argument_warns_that_it_overrides_the_resume(script):
    proc = script.run("--load", "/ckpt/x")
    assert proc.returncode == 0 and proc.stderr.startswith("warning: --load /ckpt/x")
    assert "INIT_FROM=/ckpt/x" in proc.stderr


@pytest.mark.parametrize("variables, layout", [
    ({"PP": "2"}, {"DP": "1", "MICRO_BATCHES": "2", "GLOBAL_BATCH": "16"}),  # a pipeline: one micro-batch a stage
    ({"TP": "2"}, {"DP": "1", "MICRO_BATCHES": "1", "GLOBAL_BATCH": "8"}),
    ({"GLOBAL_BATCH": "64"}, {"DP": "2", "MICRO_BATCHES": "4", "GLOBAL_BATCH": "64"}),
    ({"MICRO_BATCHES": "3", "MICRO_BATCH": "2"}, {"DP": "2", "MICRO_BATCHES": "3", "GLOBAL_BATCH": "12"}),
    ({"DS_ACCELERATOR": "cpu", "gpus": 8}, {"DEVICE": "cpu", "RANKS": "2"}),  # DeepSpeed's own switch is honoured
    ({"DEVICE": "gpu", "NUM_GPUS": "4", "TP": "2"}, {"RANKS": "4", "DP": "2", "GLOBAL_BATCH": "16"}),
    ({"gpus": 8, "LAUNCHER_ARGS": "--num_gpus 4"}, {"RANKS": "4", "DP": "4", "GLOBAL_BATCH": "32"}),
])
def test_layouts(script, variables, layout):
    variables = dict(variables)
    if "gpus" in variables:
        script.fake_gpus(variables.pop("gpus"))
    got, _, argv = dry_run(script, **variables)
    assert {k: got[k] for k in layout} == layout
    check_batch(got, argv)


def test_layout_flags_in_the_arguments_are_the_ones_checked(script):
    script.fake_gpus(8)
    layout, _, argv = dry_run(script, "--tensor-model-parallel-size=2", "--micro-batch-size", "4")
    assert (layout["TP"], layout["DP"], layout["MICRO_BATCH"], layout["GLOBAL_BATCH"]) == ("2", "4", "4", "16")
    check_batch(layout, argv)


@pytest.mark.parametrize("gpus, variables, args, fragment", [
    (8, {"TP": "3"}, (), "TP 3 x CP 1 x PP 1 = 3 does not divide the 8 ranks"),
    (8, {"CP": "3", "SEQ_LENGTH": "258"}, (), "TP 1 x CP 3 x PP 1 = 3 does not divide the 8 ranks"),
    (0, {"CP": "2", "SEQ_LENGTH": "258"}, (), "CP=2 cuts SEQ_LENGTH 258 into 4 equal chunks"),
    (0, {"CP": "0"}, (), "CP=0: must be at least 1"),
    (0, {"SEQ_LENGTH": "long"}, (), "SEQ_LENGTH=long: not a whole number"),
    (8, {"TP": "2", "PP": "3"}, (), "does not divide the 8 ranks"),
    (8, {"GLOBAL_BATCH": "100"}, (), "GLOBAL_BATCH 100 is not divisible by MICRO_BATCH 8 x DP 8 = 64"),
    (8, {}, ("--global-batch-size", "96"), "GLOBAL_BATCH 96 is not divisible"),
    (8, {"GLOBAL_BATCH": "128", "MICRO_BATCHES": "3"}, (), "MICRO_BATCHES 3 disagrees"),
    (0, {"DEVICE": "gpu"}, (), "nvidia-smi -L` lists no GPU"),
    (8, {"DEVICE": "gpu", "DS_ACCELERATOR": "cpu"}, (), "DS_ACCELERATOR=cpu"),
    (0, {"TP": "two"}, (), "TP=two: not a whole number"),
    (0, {"MICRO_BATCH": "0"}, (), "MICRO_BATCH=0: must be at least 1"),
    (0, {"CONFIG": "huge"}, (), "CONFIG=huge"),
    (0, {"DEVICE": "tpu"}, (), "DEVICE=tpu"),
    (0, {"SP": "yes"}, (), "SP=yes: use 1"),
    (0, {"RECOMPUTE": "partial"}, (), "RECOMPUTE=partial: use none, selective or full"),
    (0, {"VPP": "1"}, (), "VPP=1 (--num-layers-per-virtual-pipeline-stage) needs PP > 1"),
    (0, {"PP": "2", "VPP": "3"}, (), "VPP=3: the 4 layers do not split into chunks of 3 on each of the 2 stages "
                                     "(layers divisible by PP x VPP = 6): use VPP among: 1 2"),
    (0, {"PP": "2", "VPP": "2"}, ("--num-layers", "6"), "the 6 layers do not split into chunks of 2 on each of "
                                                         "the 2 stages (layers divisible by PP x VPP = 4): use VPP "
                                                         "among: 1 3"),
    (0, {"PP": "2", "VPP": "1", "MICRO_BATCHES": "3"}, (), "needs the micro-batches per step (MICRO_BATCHES 3"),
    (0, {"PP": "2", "VPP": "1", "GLOBAL_BATCH": "24"}, (), "use a GLOBAL_BATCH of a multiple of 16"),
    (0, {"PP": "2", "VPP": "one"}, (), "VPP=one: not a whole number"),
    (0, {"PP": "2", "VPP": "0"}, (), "VPP=0: must be at least 1"),
    (0, {"INIT_FROM": "/nonexistent/ckpt"}, (), "INIT_FROM=/nonexistent/ckpt: no such directory"),
    (0, {"HOSTFILE": "/nonexistent/hostfile", "DEVICE": "cpu"}, (), "no such file"),
    (0, {"HOSTFILE": "{bad_hostfile}", "DEVICE": "cpu"}, (), "not a 'hostname slots=N' line: node2 gpus=8"),
    # no GPU here and no DEVICE: the nodes' device is not guessed from the launching host (a login node)
    (0, {"HOSTFILE": "{bad_hostfile}"}, (), "this host has no GPU (`nvidia-smi -L` lists none), so every node would "
                                            "train on its CPU: set DEVICE=gpu (GPU nodes) or DEVICE=cpu"),
])
@pytest.mark.parametrize("dry", [True, False], ids=["dry", "real"])
def test_bad_layouts_are_refused_before_anything_runs(script, gpus, variables, args, fragment, dry):
    if gpus:
        script.fake_gpus(gpus)
    bad_hostfile = script.tmp / "bad_hostfile"
    bad_hostfile.write_text("node1 slots=8\nnode2 gpus=8\n")
    variables = {k: v.format(bad_hostfile=bad_hostfile) for k, v in variables.items()}
    proc = script.run(*args, dry=dry, **variables)
    assert proc.returncode != 0
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], proc.stderr
    assert proc.stdout == ""
    assert script.launched() == [] and list(script.cwd.iterdir()) == []
