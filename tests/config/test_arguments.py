"""The command line, its validation, the DeepSpeed config built from it, and the LR schedule: pure logic."""

import json
import math
import subprocess
import sys

import pytest
import torch

from codegeex_train.config.arguments import ConfigError, parse_args, parser, validate
from codegeex_train.config.deepspeed import build_deepspeed_config
from codegeex_train.training.optim import LRSchedule, parameter_groups

MEGATRON_FLAGS = """--num-layers --hidden-size --num-attention-heads --ffn-hidden-size --seq-length
--max-position-embeddings --make-vocab-size-divisible-by --tensor-model-parallel-size
--pipeline-model-parallel-size --micro-batch-size --global-batch-size --num-microbatches --train-iters --optimizer
--lr --learning-rate --min-lr --lr-decay-style --lr-decay-iters --lr-warmup-iters --lr-warmup-fraction
--weight-decay --clip-grad --adam-beta1 --adam-beta2 --seed --data-path --train-data-path --valid-data-path --split
--tokenizer-type --tokenizer-model --vocab-file --merge-file --distributed-backend --fp16 --bf16
--checkpoint-activations --save --load --log-interval --save-interval --eval-interval --eval-iters --num-workers
--deepspeed-config --zero-stage --wandb-project --wandb-name""".split()


def test_every_megatron_flag_exists_with_help():
    actions = {s: a for a in parser()._actions for s in a.option_strings}
    for flag in MEGATRON_FLAGS:
        assert flag in actions, flag
        assert actions[flag].help and len(actions[flag].help) > 10, flag


def test_help_runs():
    out = subprocess.run([sys.executable, "-m", "codegeex_train.pretrain", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--tensor-model-parallel-size" in out.stdout


def args_for(*argv):
    return parse_args(["--data-path", "x", *argv])


def test_batch_arithmetic_is_derived_once():
    layout = validate(args_for("--micro-batch-size", "2", "--global-batch-size", "32",
                             "--tensor-model-parallel-size", "2"), world_size=8)
    assert (layout.dims.dp_size, layout.num_microbatches, layout.global_batch_size) == (4, 4, 32)
    default = validate(args_for("--micro-batch-size", "3"), world_size=2)
    assert default.global_batch_size == 6 and default.num_microbatches == 1
    # --learning-rate is Megatron's alias of --lr: both set the same field, to a value that is not the default.
    assert args_for().optim.lr != 0.5
    assert args_for("--learning-rate", "0.5").optim.lr == args_for("--lr", "0.5").optim.lr == 0.5


@pytest.mark.parametrize("argv,world,message", [
    (["--micro-batch-size", "4", "--global-batch-size", "10"], 2, "not divisible by --micro-batch-size 4"),
    (["--global-batch-size", "16", "--micro-batch-size", "4", "--num-microbatches", "3"], 2, "--num-microbatches 3"),
    (["--tensor-model-parallel-size", "3"], 4, "world size 4"),
    (["--num-attention-heads", "6", "--hidden-size", "60", "--tensor-model-parallel-size", "4"], 4,
     "--num-attention-heads 6"),
    (["--seq-length", "2048", "--max-position-embeddings", "1024"], 1, "--max-position-embeddings 1024"),
    (["--num-layers", "3", "--pipeline-model-parallel-size", "2"], 2, "--num-layers 3"),
    (["--fp16", "--bf16"], 1, "--fp16 and --bf16"),
    (["--lr-warmup-iters", "5", "--lr-warmup-fraction", "0.1"], 1, "--lr-warmup-fraction"),
])
def test_invalid_combinations(argv, world, message):
    with pytest.raises(ConfigError, match=message):
        validate(args_for(*argv), world)


def test_deepspeed_config_flows_from_flags():
    # Every value below differs from its default (micro-batch 4, clip 1.0, fp32, ZeRO stage 2), so each
    # assert sees the flag's value arrive rather than a default.
    args = args_for("--micro-batch-size", "2", "--global-batch-size", "16", "--clip-grad", "0.5", "--bf16",
                    "--zero-stage", "1")
    layout = validate(args, 4)
    cfg = build_deepspeed_config(args, layout, {"zero_optimization": {"reduce_bucket_size": 1000}})
    assert cfg["train_batch_size"] == 16 and cfg["train_micro_batch_size_per_gpu"] == 2
    assert cfg["gradient_accumulation_steps"] == 2 and cfg["gradient_clipping"] == 0.5
    assert cfg["bf16"]["enabled"] is True and cfg["fp16"]["enabled"] is False
    assert cfg["zero_optimization"] == {"reduce_bucket_size": 1000, "stage": 1, "contiguous_gradients": True,
                                        "overlap_comm": False}
    fp16 = args_for("--fp16")
    assert build_deepspeed_config(fp16, validate(fp16, 1))["fp16"]["loss_scale"] == 0  # dynamic


@pytest.mark.parametrize("user,message", [
    ({"train_batch_size": 64}, "train_batch_size = 64 but --global-batch-size gives 8"),
    ({"zero_optimization": {"stage": 3}}, "zero_optimization.stage = 3 but --zero-stage gives 2"),
    ({"fp16": {"enabled": True}}, "fp16.enabled = True but --fp16 gives False"),
    ({"optimizer": {"type": "Adam"}}, "'optimizer' section"),
])
def test_deepspeed_json_contradictions_name_both(user, message):
    args = args_for("--micro-batch-size", "4", "--global-batch-size", "8")
    with pytest.raises(ConfigError, match=message):
        build_deepspeed_config(args, validate(args, 2), user)


@pytest.mark.parametrize("name,precision", [("cpu_fp32_zero2", []), ("gpu_bf16_zero2", ["--bf16"]),
                                            ("gpu_fp16_zero2", ["--fp16"])])
def test_shipped_deepspeed_configs_are_consistent(name, precision):
    with open(f"ds_configs/{name}.json") as f:
        user = json.load(f)
    # Non-default flags (clip 1.0, micro-batch 4 and no accumulation by default) must reach the config beside the
    # file's own settings, which must survive untouched.
    args = args_for(*precision, "--clip-grad", "0.25", "--micro-batch-size", "2", "--global-batch-size", "8")
    cfg = build_deepspeed_config(args, validate(args, 2), user)
    assert cfg["gradient_clipping"] == 0.25 and cfg["gradient_accumulation_steps"] == 2
    assert cfg["train_micro_batch_size_per_gpu"] == 2 and cfg["train_batch_size"] == 8
    assert cfg["zero_optimization"] == user["zero_optimization"]  # the file's settings, untouched
    if precision:  # a GPU config used without its precision flag is a contradiction, not a silent switch
        plain = args_for()
        with pytest.raises(ConfigError, match=precision[0]):
            build_deepspeed_config(plain, validate(plain, 1), user)


def _schedule(**kw):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    args = args_for(*[x for k, v in kw.items() for x in (f"--{k.replace('_', '-')}", str(v))])
    return LRSchedule(opt, args.optim, train_iters=args.train.train_iters), opt


def test_lr_schedule_warmup_then_cosine_and_linear():
    s, opt = _schedule(lr=1.0, min_lr=0.1, lr_warmup_iters=4, lr_decay_iters=14)
    assert opt.param_groups[0]["lr"] == 0.0  # Megatron: step 0 of a warm-up has lr 0
    assert [s.lr_at(i) for i in (1, 2, 4)] == [0.25, 0.5, 1.0]
    assert s.lr_at(9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert s.lr_at(14) == s.lr_at(100) == pytest.approx(0.1)
    lin, _ = _schedule(lr=1.0, min_lr=0.0, lr_decay_style="linear", lr_warmup_fraction=0.2, lr_decay_iters=10)
    assert lin.warmup_iters == 2 and lin.lr_at(6) == pytest.approx(0.5)
    s.step(5)
    assert opt.param_groups[0]["lr"] == pytest.approx(s.lr_at(5))
    restored, opt2 = _schedule(lr=1.0, min_lr=0.1, lr_warmup_iters=4, lr_decay_iters=14)
    restored.load_state_dict(s.state_dict())
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def test_no_weight_decay_for_biases_and_norms():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    decay, no_decay = parameter_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and [p.shape for p in decay["params"]] == [(4, 4)]
    assert no_decay["weight_decay"] == 0.0 and len(no_decay["params"]) == 3


def test_fewer_microbatches_than_stages_warns():
    args = args_for("--num-layers", "4", "--pipeline-model-parallel-size", "4", "--micro-batch-size", "2",
                    "--global-batch-size", "4")
    with pytest.warns(UserWarning, match=r"2 micro-batch\(es\) per step for 4 pipeline stages.*60%"):
        layout = validate(args, 4)
    assert layout.num_microbatches == 2
    assert layout.stage_layers == (range(0, 1), range(1, 2), range(2, 3), range(3, 4))
    args = args_for("--num-layers", "5", "--pipeline-model-parallel-size", "2", "--decoder-last-pipeline-num-layers", "2",
                    "--global-batch-size", "16", "--micro-batch-size", "4")
    assert validate(args, 2).stage_layers == (range(0, 3), range(3, 5))


def test_virtual_pipeline_layout():
    """--num-layers-per-virtual-pipeline-stage: rank r holds virtual stages r, r + p, ...; N = layers / p is v = 1,
    the plain 1F1B layout exactly."""
    pp2 = ("--num-layers", "8", "--pipeline-model-parallel-size", "2", "--global-batch-size", "16")
    layout = validate(args_for(*pp2, "--num-layers-per-virtual-pipeline-stage", "2"), 2)
    assert layout.num_chunks == 2
    assert layout.chunk_layers == ((range(0, 2), range(4, 6)), (range(2, 4), range(6, 8)))
    assert layout.stage_layers == ((0, 1, 4, 5), (2, 3, 6, 7))
    assert layout.rank_chunks(1) == (range(2, 4), range(6, 8))
    layout = validate(args_for("--num-layers", "12", "--pipeline-model-parallel-size", "2", "--global-batch-size",
                               "16", "--num-layers-per-virtual-pipeline-stage", "2"), 2)
    assert layout.num_chunks == 3 and layout.rank_chunks(0) == (range(0, 2), range(4, 6), range(8, 10))
    plain = validate(args_for(*pp2), 2)
    assert validate(args_for(*pp2, "--num-layers-per-virtual-pipeline-stage", "4"), 2) == plain
    assert plain.num_chunks == 1 and plain.rank_chunks(1) == (range(4, 8),)


# --- Sequence parallelism and recompute (--sequence-parallel, --recompute-*) ------------------------------------

def test_recompute_flags_give_one_recompute():
    from codegeex_train.layout.recompute import Recompute

    def recompute(*argv):
        return validate(args_for("--num-layers", "4", *argv), 1).recompute

    assert recompute() == Recompute()
    assert recompute("--checkpoint-activations") == recompute("--recompute-granularity", "full") == Recompute("full")
    assert recompute("--checkpoint-activations", "--recompute-granularity", "full", "--recompute-method", "block",
                     "--recompute-num-layers", "4") == Recompute("full", "block", 4)
    assert recompute("--recompute-granularity", "selective") == Recompute("selective", modules=("core_attn",))
    assert recompute("--recompute-granularity", "selective", "--recompute-modules", "mlp_act", "layernorm",
                     "mlp_act") == Recompute("selective", modules=("mlp_act", "layernorm"))


@pytest.mark.parametrize("argv,message", [
    (["--checkpoint-activations", "--recompute-granularity", "selective"],
     "--checkpoint-activations .full recompute. and --recompute-granularity selective clash"),
    (["--recompute-method", "block"],
     "--recompute-method and --recompute-num-layers go with --recompute-granularity full"),
    (["--recompute-granularity", "selective", "--recompute-num-layers", "2"],
     "--recompute-method and --recompute-num-layers go with"),
    (["--recompute-modules", "mlp_act"], "--recompute-modules goes with --recompute-granularity selective"),
    (["--checkpoint-activations", "--recompute-modules", "core_attn"], "--recompute-modules goes with"),
    (["--recompute-granularity", "full", "--recompute-num-layers", "5"],
     "--recompute-num-layers 5 must be within 1..--num-layers 4"),
    (["--recompute-granularity", "full", "--recompute-num-layers", "0"], "--recompute-num-layers 0 must be within"),
    (["--recompute-granularity", "selective", "--recompute-modules", "core_attn", "mlp"],
     "--recompute-modules mlp: choose from core_attn, mlp_act, layernorm"),
    (["--tensor-model-parallel-size", "4", "--sequence-parallel", "--seq-length", "30"],
     "--sequence-parallel splits --seq-length 30 over --tensor-model-parallel-size 4: use a sequence length"),
], ids=["checkpoint-activations+selective", "method-without-full", "num-layers-with-selective",
        "modules-without-selective", "modules-with-full", "num-layers-above-num-layers", "num-layers-0",
        "unknown-module", "sp-seq-length-not-divisible"])
def test_recompute_and_sequence_parallel_clashes(argv, message):
    with pytest.raises(ConfigError, match=message):
        validate(args_for("--num-layers", "4", *argv), 4)


def test_sequence_parallel_at_tp1_warns_once_and_passes(recwarn):
    # Training with it is the same as without: tests/training/test_sequence_parallel.py.
    validate(args_for("--sequence-parallel", "--seq-length", "30", "--tensor-model-parallel-size", "2"), 2)
    validate(args_for("--seq-length", "30"), 2)
    assert len(recwarn) == 0  # TP 2 with a fitting length, or no SP: nothing to say
    with pytest.warns(UserWarning, match="--sequence-parallel with --tensor-model-parallel-size 1 does nothing"):
        layout = validate(args_for("--sequence-parallel", "--seq-length", "30"), 2)  # 30 would not split over 2
    assert layout.dims.tp_size == 1 and layout.dims.dp_size == 2


def test_sequence_length_not_divisible_by_tp_is_one_line_before_any_process_group(capsys, monkeypatch, tmp_path):
    import torch.distributed as dist

    from codegeex_train import pretrain

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(SystemExit) as e:
        pretrain.main(["--data-path", str(tmp_path / "none"), "--tensor-model-parallel-size", "4",
                       "--sequence-parallel", "--seq-length", "30", "--num-layers", "2", "--hidden-size", "32",
                       "--num-attention-heads", "4", "--max-position-embeddings", "64"])
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [("error: --sequence-parallel splits --seq-length 30 over --tensor-model-parallel-size "
                                 "4: use a sequence length divisible by 4")], err
    assert not dist.is_initialized() and list(tmp_path.iterdir()) == []


def test_context_parallel_layout_and_batch_arithmetic():
    # 16 ranks = TP 2 x CP 2 x PP 2 x DP 2: CP is a dimension of the plan, not of the batch (DP stays 2)
    plan = validate(args_for("--tensor-model-parallel-size", "2", "--context-parallel-size", "2",
                             "--pipeline-model-parallel-size", "2", "--num-layers", "4", "--seq-length", "64",
                             "--micro-batch-size", "2", "--global-batch-size", "8", "--max-position-embeddings", "64",
                             "--sequence-parallel"), world_size=16)
    assert (plan.tp_size, plan.cp_size, plan.pp_size, plan.dp_size) == (2, 2, 2, 2)
    assert (plan.num_microbatches, plan.global_batch_size, plan.local_seq_length) == (2, 8, 32)
    assert plan.p2p_shape == (2, 16, 256)  # s / CP / TP under SP
    # DeepSpeed's data-parallel world is DP x CP: its train batch counts each CP rank's share of a sequence once
    config = build_deepspeed_config(args_for("--context-parallel-size", "2", "--micro-batch-size", "2",
                                             "--seq-length", "64"), validate(
        args_for("--context-parallel-size", "2", "--micro-batch-size", "2", "--seq-length", "64"), world_size=4))
    assert (config["train_batch_size"], config["train_micro_batch_size_per_gpu"],
            config["gradient_accumulation_steps"]) == (8, 2, 1)


@pytest.mark.parametrize("argv,world,message", [
    (["--context-parallel-size", "2", "--seq-length", "66"], 2, "divisible by 4"),
    (["--context-parallel-size", "3"], 4, "x context-parallel size 3"),
    (["--context-parallel-size", "2", "--seq-length", "36", "--tensor-model-parallel-size", "4",
      "--sequence-parallel"], 8, "each CP rank's 18 tokens.*divisible by 8"),
    (["--context-parallel-size", "2", "--reset-attention-mask"], 2, "--reset-attention-mask with"),
    (["--context-parallel-size", "2", "--eval-humaneval-interval", "5"], 2, "--context-parallel-size 1"),
    (["--context-parallel-size", "0"], 2, "--context-parallel-size"),
])
def test_context_parallel_refusals_name_the_flags(argv, world, message):
    with pytest.raises(ConfigError, match=message):
        validate(args_for(*argv), world)
