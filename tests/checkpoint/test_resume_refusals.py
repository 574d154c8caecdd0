"""``--load`` never resumes with less than the checkpoint holds, and never meets tensors of another shape than the
model's after the ranks have started: either is one ``error:`` line (exit 2) before any process group, naming what is
missing or which parameter differs, and the flags that deliberately load less (--no-load-optim, --finetune), which
are then accepted.

One real training checkpoint (TP 2, DP 1: two model-parallel ranks, each with its model file and its ZeRO file) is
made once per module and copied per test, then damaged as a lost file, a renamed directory or a foreign file would."""

import re
import shutil

import pytest
import torch
import torch.distributed as dist

from codegeex_train import pretrain
from codegeex_train.checkpoint.deepspeed_files import check_zero_partitions, tag_files
from codegeex_train.checkpoint.files import (
    CheckpointError,
    META_KEY,
    model_parameter_shapes,
    rank_parameter_shapes,
    save_model_checkpoint,
    write_latest,
)
from codegeex_train.checkpoint.resume import ResumeKind
from codegeex_train.checkpoint.sharding import split_model_parallel
from codegeex_train.config.model_config import ModelConfig
from codegeex_train.model.codegeex import CodeGeeXModel
from codegeex_train.tokenization.tokenizer import DEFAULT_TOKENIZER_PATH
from tests.harness import another_tokenizer, fails_with, load_tool, run_distributed, run_pretrain, tiny_pretrain_args

TP2 = ("--tensor-model-parallel-size", "2")
TAG = "iter_0000002"
ZERO = "zero_pp_rank_0_mp_rank_{:02d}_optim_states.pt"
MODEL = "mp_rank_{:02d}_model_states.pt"
LOAD_LESS = ("--no-load-optim", "--finetune")
CONFIG = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, max_position_embeddings=64, vocab_size=8192)


@pytest.fixture(scope="module")
def saved(tiny_data, tmp_path_factory):
    """A 2-iteration run at TP 2 saved at its end; its weights-only and universal conversions."""
    root = tmp_path_factory.mktemp("resume_refusals")
    run_distributed(run_pretrain, world_size=2, tp_size=2, deadline_s=300,
                    argv=tiny_pretrain_args(tiny_data, str(root / "training"), 2, *TP2))
    modules = [torch.load(root / "training" / TAG / MODEL.format(r), weights_only=False)["module"] for r in (0, 1)]
    save_model_checkpoint(root / "weights", modules, CONFIG, 2, tag=TAG, iteration=2)
    load_tool("convert_checkpoint").main(["--load", str(root / "training"), "--to-universal", str(root / "universal")])
    return root


@pytest.fixture
def copy(saved, tmp_path, monkeypatch):
    """``copy(kind)``: a copy of that checkpoint (training, weights, universal) to damage; runs see 2 ranks."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.chdir(tmp_path)
    return lambda kind="training": shutil.copytree(saved / kind, tmp_path / kind)


def argv(data, load, *extra):
    # 2 more iterations, the checkpoint's LR decay kept (its --train-iters 2): the schedule is the same
    return tiny_pretrain_args(data, "out", 4, *TP2, "--lr-decay-iters", "2", "--load", str(load), *extra)


def accepted(argv):
    """What the preflight lets this run restore (``Resume``), checked without any process group."""
    resume = pretrain.prepare(argv).resume
    assert not dist.is_initialized()
    return resume


def edit(path, change) -> None:
    state = torch.load(path, map_location="cpu", weights_only=False)  # ours: trusted
    change(state)
    torch.save(state, path)


# --- a training checkpoint missing a part: refused, unless the flags say to load less ----------------------------

@pytest.mark.parametrize("lost", [(0, 1), (1,)], ids=["every_optimizer_file", "one_rank_optimizer_file"])
def test_missing_optimizer_files_refused_unless_no_load_optim(copy, tiny_data, capsys, lost):
    ckpt = copy()
    for mp_rank in lost:
        (ckpt / TAG / ZERO.format(mp_rank)).unlink()
    fails_with(capsys, argv(tiny_data, ckpt), f"--load {ckpt}: {ckpt / TAG} lacks the ZeRO optimizer file",
               ZERO.format(1), f"({len(lost)} of 2: DP 1 x 2 model-parallel ranks", *LOAD_LESS)
    resume = accepted(argv(tiny_data, ckpt, "--no-load-optim"))  # the iteration, LR schedule and RNG continue
    assert (resume.kind, resume.load_optim, resume.finetune) == (ResumeKind.TRAINING, False, False)
    resume = accepted(argv(tiny_data, ckpt, "--finetune"))
    assert (resume.kind, resume.finetune) == (ResumeKind.TRAINING, True)


def test_missing_model_file_refused_whatever_the_flags(copy, tiny_data, capsys):
    ckpt = copy()
    (ckpt / TAG / MODEL.format(1)).unlink()
    for flags in ((), ("--no-load-optim",), ("--finetune",)):
        fails_with(capsys, argv(tiny_data, ckpt, *flags), f"{ckpt / TAG} lacks {MODEL.format(1)} (1 of its 2 "
                   "model files: TP 2 x PP 1, as its metadata records)", "no flag loads", f"{ckpt}/latest")


def test_missing_training_state_refused_unless_finetune(copy, tiny_data, capsys):
    """Model files of a training run without its training state (and without the ZeRO files, as a weights-only
    checkpoint would be): its DeepSpeed fields still tell what it is."""
    ckpt = copy()
    for mp_rank in (0, 1):
        (ckpt / TAG / ZERO.format(mp_rank)).unlink()
        edit(ckpt / TAG / MODEL.format(mp_rank), lambda state: state[META_KEY].pop("train_state"))
    for flags in ((), ("--no-load-optim",)):
        fails_with(capsys, argv(tiny_data, ckpt, *flags), "records no training state",
                   "DeepSpeed's fields in the model file", "pass --finetune")
    resume = accepted(argv(tiny_data, ckpt, "--finetune"))
    assert (resume.kind, resume.finetune) == (ResumeKind.TRAINING, True)


def _set_dp_world_size(state):
    state["dp_world_size"] = 2


def _set_mp_world_size(state):
    state["mp_world_size"] = 4


def _set_train_state_iteration(state):
    state[META_KEY]["train_state"]["iteration"] = 1


def _rename_tag(ckpt):
    (ckpt / TAG).rename(ckpt / "iter_0000004")
    write_latest(ckpt, "iter_0000004")


DISAGREEING = {  # damage, what the line says, the flags it names
    "tag_renamed": (_rename_tag, "records iteration 2, but its tag directory is iter_0000004", ("--finetune",)),
    "train_state_of_another_iteration": (
        lambda ckpt: [edit(ckpt / TAG / MODEL.format(r), _set_train_state_iteration) for r in (0, 1)],
        "its training state is at iteration 1, its metadata at 2", ("--finetune",)),
    "recorded_mp_beyond_files": (
        lambda ckpt: [edit(ckpt / TAG / MODEL.format(r), _set_mp_world_size) for r in (0, 1)],
        "DeepSpeed recorded 4 model-parallel ranks, the metadata TP x PP = 2", ("--finetune",)),
    "model_file_of_another_save": (
        lambda ckpt: edit(ckpt / TAG / MODEL.format(1), lambda s: s[META_KEY].__setitem__("iteration", 1)),
        f"{MODEL.format(1)} records iteration 1 (mp_rank_00: 2): files of different saves", ("no flag loads",)),
    "model_file_beyond_tp_x_pp": (
        lambda ckpt: shutil.copy(ckpt / TAG / MODEL.format(1), ckpt / TAG / MODEL.format(2)),
        f"holds {MODEL.format(2)} beyond its 2 model files (TP 2 x PP 1", ("no flag loads",)),
    "zero_file_beyond_dp": (
        lambda ckpt: shutil.copy(ckpt / TAG / ZERO.format(0), ckpt / TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
        "holds zero_pp_rank_1_mp_rank_00_optim_states.pt beyond its 2 ZeRO optimizer files (DP 1 x 2", LOAD_LESS),
    "recorded_dp_beyond_files": (
        lambda ckpt: [edit(ckpt / TAG / MODEL.format(r), _set_dp_world_size) for r in (0, 1)],
        "lacks the ZeRO optimizer files zero_pp_rank_1_mp_rank_00_optim_states.pt, "
        "zero_pp_rank_1_mp_rank_01_optim_states.pt (2 of 4: DP 2 x 2", LOAD_LESS),
}


@pytest.mark.parametrize("case", sorted(DISAGREEING))
def test_train_state_disagreeing_with_the_files_is_refused(copy, tiny_data, capsys, case):
    damage, message, flags = DISAGREEING[case]
    ckpt = copy()
    damage(ckpt)
    fails_with(capsys, argv(tiny_data, ckpt), message, *flags)


def test_no_load_flags_refused_at_weights_only(copy, tiny_data, capsys):
    ckpt = copy("weights")
    for flag in ("--no-load-optim", "--no-load-rng"):
        fails_with(capsys, argv(tiny_data, ckpt, flag), f"{flag}: --load {ckpt} ({TAG}) holds model weights "
                   "only, no training state to continue", f"drop {flag}")
    assert accepted(argv(tiny_data, ckpt, "--finetune")).kind is ResumeKind.WEIGHTS


# --- tensors of another shape than the model's -------------------------------------------------------------------

def _narrow_word_table(module):
    module["word_embeddings.weight"] = module["word_embeddings.weight"][:, :16].clone()


def _universal(ckpt, change):
    from safetensors.torch import load_file, save_file

    for state in ("fp32", "exp_avg", "exp_avg_sq"):  # all three alike: only the model's shape disagrees
        path = ckpt / TAG / f"{state}.safetensors"
        tensors = load_file(str(path))
        change(tensors)
        save_file(tensors, str(path))


NARROWED = "parameter word_embeddings.weight has shape ({rows}, 16) in the checkpoint, the model built from the " \
           "flags has ({rows}, 32)"


@pytest.mark.parametrize("kind, flags, damage, message", [
    ("training", (), _narrow_word_table, NARROWED.format(rows=4096)),
    ("training", ("--finetune",), _narrow_word_table, NARROWED.format(rows=4096)),
    ("weights", (), _narrow_word_table, NARROWED.format(rows=4096)),
    ("weights", (), lambda m: m.pop("final_layernorm.bias"), "it lacks parameter final_layernorm.bias, which the "
                                                             "model built from the flags has (shape (32,))"),
    ("weights", (), lambda m: m.__setitem__("layers.2.input_layernorm.weight", torch.ones(32)),
     "it holds parameter layers.2.input_layernorm.weight, which the model built from the flags lacks"),
    ("universal", (), _narrow_word_table, NARROWED.format(rows=8192)),
], ids=["training", "training_finetune", "weights", "weights_missing_name", "weights_extra_name", "universal"])
def test_tensor_of_another_shape_is_one_line(copy, tiny_data, capsys, kind, flags, damage, message):
    """The recorded model is the flags' (that check passes): the tensors themselves differ."""
    ckpt = copy(kind)
    if kind == "universal":
        _universal(ckpt, damage)
        where = ckpt / TAG / "fp32.safetensors"
    else:
        edit(ckpt / TAG / MODEL.format(0), lambda state: damage(state["module"]))
        where = ckpt / TAG / MODEL.format(0)
    fails_with(capsys, argv(tiny_data, ckpt, *flags), f"error: --load {ckpt}: {where}: {message}; its "
               "metadata records the model of these flags")


def test_model_of_other_flags_names_the_checkpoints_flags(copy, tiny_data, capsys):
    ckpt = copy()
    fails_with(capsys, argv(tiny_data, ckpt, "--hidden-size", "64", "--no-top-query-layer"),
               "hidden_size: checkpoint 32, this run 64", "(--hidden-size 32, --top-query-layer)")


def test_zero_files_of_another_model_are_refused(saved):
    """The ZeRO partitions hold each parameter's values between their DP ranks: as many as the model has."""
    files = tag_files(saved / "training" / TAG)
    ours = {r: rank_parameter_shapes(CONFIG, 2, [range(2)], 0) for r in (0, 1)}
    check_zero_partitions(files, ours)
    wider = ModelConfig(**{**CONFIG.__dict__, "ffn_hidden_size": 256})
    with pytest.raises(CheckpointError, match=r"model-parallel rank 0 hold 2048 values of parameter "
                                              r"layers\.0\.mlp\.dense_h_to_4h\.weight across the DP ranks; the model "
                                              r"built from the flags has 4096 \(shape \(128, 32\)\)"):
        check_zero_partitions(files, {r: rank_parameter_shapes(wider, 2, [range(2)], 0) for r in (0, 1)})


# --- the tokenizer the checkpoint was trained with: its fingerprint -----------------------------------------------

@pytest.fixture
def unrecorded_data(tiny_data, tmp_path):
    """tiny_data without its tokenizer record (PREFIX.meta.json), as data preprocessed before records: the data check
    leaves the tokenizer to the resume check."""
    for suffix in (".bin", ".idx"):
        shutil.copy(tiny_data + suffix, tmp_path / f"unrecorded{suffix}")
    return str(tmp_path / "unrecorded")


@pytest.mark.parametrize("kind", ["training", "universal"])
def test_another_tokenizer_is_refused_on_resume(copy, unrecorded_data, capsys, tmp_path, kind):
    """A tokenizer of the same size (the same padded vocabulary, so the same shapes) whose ids mean other tokens is
    refused; the checkpoint's tokenizer by another path (a Hugging Face directory) resumes."""
    ckpt = copy(kind)
    other = another_tokenizer(tmp_path / "other")
    line = fails_with(capsys, argv(unrecorded_data, ckpt, "--tokenizer-type", "HFTokenizer",
                                   "--tokenizer-model", other, "--whitespace-encoding"),
                      f"--load {ckpt} ({TAG}) was trained with another tokenizer than this run's: the shipped default "
                      "(with whitespace encoding), fingerprint ", f", 8192 ids; this run's is HFTokenizer {other}, "
                      "whitespace encoding, which has fingerprint ", " over those ids: pass no tokenizer flags (the "
                      "shipped default), as the run that saved it did")
    assert len(set(re.findall(r"fingerprint ([0-9a-f]{16})", line))) == 2
    hf = tmp_path / "hf"
    hf.mkdir()
    shutil.copy(DEFAULT_TOKENIZER_PATH, hf / "tokenizer.json")
    same = ("--tokenizer-type", "HFTokenizer", "--tokenizer-model", str(hf), "--whitespace-encoding")
    assert accepted(argv(unrecorded_data, ckpt, *same)).kind is ResumeKind(kind)


def test_a_checkpoint_without_a_fingerprint_is_not_checked(copy, unrecorded_data, tmp_path):
    """Saved before fingerprints, or converted from elsewhere: the tokenizer is the user's to choose, as before."""
    ckpt = copy("weights")  # save_model_checkpoint without tokenizer settings
    other = another_tokenizer(tmp_path / "other")
    flags = ("--tokenizer-type", "HFTokenizer", "--tokenizer-model", other, "--whitespace-encoding")
    assert accepted(argv(unrecorded_data, ckpt, *flags)).kind is ResumeKind.WEIGHTS


# --- the shapes come from the config alone, and are the model's --------------------------------------------------

@pytest.mark.parametrize("top_query_layer", [True, False])
def test_shapes_from_the_config_are_the_models(top_query_layer):
    config = ModelConfig(num_layers=3, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48,
                         max_position_embeddings=64, vocab_size=8000, top_query_layer=top_query_layer)
    full = CodeGeeXModel(config, None, None).state_dict()
    assert list(model_parameter_shapes(config).items()) == [(n, tuple(t.shape)) for n, t in full.items()]
    stages = [range(0, 1), range(1, 3)]
    for mp_rank, shard in enumerate(split_model_parallel(full, config, 2, stages)):  # TP 2 x PP 2
        expected = rank_parameter_shapes(config, 2, stages, mp_rank // 2)
        assert list(expected.items()) == [(n, tuple(t.shape)) for n, t in shard.items()], mp_rank
