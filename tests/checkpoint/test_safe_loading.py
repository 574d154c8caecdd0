"""Checkpoint files are unpickled weights-only: a file whose pickle would run code is refused by ``--load`` and by
tools/convert_checkpoint.py with one line naming the file, and the code never runs; genuine checkpoints (ours and
DeepSpeed's, with the allow-listed DeepSpeed types) still load; --to-hf writes safetensors."""

import collections
import importlib.util
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from codegeex_train import pretrain
from codegeex_train.checkpoint.files import load_model_shard, read_checkpoint_meta, save_model_checkpoint
from codegeex_train.checkpoint.safe_load import (
    CheckpointError,
    UnsafeCheckpointError,
    safe_torch_load,
    verify_checkpoint_dir,
)
from codegeex_train.config.model_config import ModelConfig
from codegeex_train.model.codegeex import CodeGeeXModel
from tests.harness import fails_with, run_distributed, tiny_model_args

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONVERT = ROOT / "tools" / "convert_checkpoint.py"
MODEL = tiny_model_args()


class TouchOnUnpickle:
    """Unpickling this calls ``pathlib.Path.touch(marker)``: the stand-in for what a tampered checkpoint runs."""

    def __init__(self, marker):
        self.marker = pathlib.Path(marker)

    def __reduce__(self):
        return pathlib.Path.touch, (self.marker,)


def tamper(path, marker, **save_kwargs):
    """Rewrite a genuine checkpoint file (trusted here: we just wrote it) with the payload added."""
    state = torch.load(path, map_location="cpu", weights_only=False)
    state["payload"] = TouchOnUnpickle(marker)
    torch.save(state, path, **save_kwargs)


def assert_refused_one_line(text: str, path) -> None:
    assert "\n" not in text.strip(), text
    assert f"refusing checkpoint file {path}: " in text, text
    assert "getattr" in text and "nothing in it was run" in text, text  # the global the payload needs


def run_pretrain(topology, argv):
    pretrain.main(argv)


@pytest.fixture(scope="module")
def real_checkpoint(tiny_data, tmp_path_factory):
    """A DeepSpeed ZeRO-2 training checkpoint (DP 2: two optimizer partitions) of a 2-iteration run."""
    save = str(tmp_path_factory.mktemp("real") / "ckpt")
    argv = MODEL + ["--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2", "--log-interval",
                    "1", "--eval-interval", "1000", "--eval-iters", "1", "--data-path", tiny_data, "--split",
                    "90,9,1", "--save", save, "--no-progress-bar", "--num-workers", "0",
                    "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1"]
    run_distributed(run_pretrain, world_size=2, tp_size=1, deadline_s=600, argv=argv)
    return pathlib.Path(save)


# --- the loader itself ------------------------------------------------------------------------------------------

def test_allow_listed_deepspeed_types_round_trip(tmp_path):
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    dynamic = DynamicLossScaler(init_scale=2.0**16, scale_window=1000, min_scale=1.0, delayed_shift=2,
                                consecutive_hysteresis=False, dtype=torch.half)
    state = {"static": LossScaler(1.0), "dynamic": dynamic, "stage": ZeroStageEnum.gradients,
             "slices": [{"w": fragment_address(numel=6, start=2)}],
             "shapes": [collections.OrderedDict(w=torch.Size([2, 3]))], "t": torch.arange(4.0)}
    torch.save(state, tmp_path / "ds.pt")
    back = safe_torch_load(tmp_path / "ds.pt")
    assert vars(back["static"]) == vars(state["static"]) and vars(back["dynamic"]) == vars(dynamic)
    assert back["stage"] is ZeroStageEnum.gradients and back["slices"] == state["slices"]
    assert back["shapes"] == state["shapes"] and torch.equal(back["t"], state["t"])


@pytest.mark.parametrize("zipfile", [True, False], ids=["zip", "legacy"])
def test_tampered_file_is_refused_and_nothing_runs(tmp_path, zipfile):
    path, marker = tmp_path / "model.pt", tmp_path / "pwned"
    torch.save({"module": {"w": torch.ones(2)}, "payload": TouchOnUnpickle(marker)}, path,
               _use_new_zipfile_serialization=zipfile)
    for mmap in (False, True):
        with pytest.raises(UnsafeCheckpointError) as err:
            safe_torch_load(path, mmap=mmap)
        assert_refused_one_line(str(err.value), path)
    assert not marker.exists()
    torch.load(path, weights_only=False)  # the payload is real: a plain unpickle runs it
    assert marker.exists()


def test_unreadable_files_are_one_line_errors(tmp_path):
    good = tmp_path / "good.pt"
    torch.save({"w": torch.ones(1000)}, good)
    (tmp_path / "empty.pt").write_bytes(b"")
    (tmp_path / "truncated.pt").write_bytes(good.read_bytes()[:500])
    (tmp_path / "text.pt").write_text("not a checkpoint\n")
    for name, message in [("empty.pt", "EOFError"), ("truncated.pt", "zip archive"), ("text.pt", ""),
                          ("missing.pt", "No such file"), (".", "Is a directory")]:
        with pytest.raises(CheckpointError, match=re.escape(str(tmp_path / name))) as err:
            safe_torch_load(tmp_path / name)
        assert message in str(err.value) and "\n" not in str(err.value)


# --- a real DeepSpeed checkpoint ------------------------------------------------------------------------------

@pytest.mark.slow
def test_genuine_deepspeed_checkpoint_passes(real_checkpoint):
    tag, meta = read_checkpoint_meta(real_checkpoint)
    files = verify_checkpoint_dir(real_checkpoint, tag)
    assert sorted(f.name for f in files) == ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                             "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    optim = safe_torch_load(files[1])["optimizer_state_dict"]
    assert type(optim["loss_scaler"]).__name__ == "LossScaler"  # why the allow-list holds DeepSpeed's types
    assert meta["iteration"] == 2 and isinstance(meta["train_state"]["rng"]["cpu"], torch.Tensor)
    sd, _ = load_model_shard(real_checkpoint, ModelConfig(**meta["model_config"]), tp_size=1, tp_rank=0)
    assert "word_embeddings.weight" in sd


@pytest.mark.parametrize("victim", ["mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"])
def test_load_refuses_a_tampered_checkpoint(real_checkpoint, tiny_data, tmp_path, capsys, monkeypatch, victim):
    ckpt, marker = tmp_path / "ckpt", tmp_path / "pwned"
    shutil.copytree(real_checkpoint, ckpt)
    tag = (ckpt / "latest").read_text().strip()
    tamper(ckpt / tag / victim, marker)
    monkeypatch.setenv("WORLD_SIZE", "2")  # the layout it was saved at: only the tampering is wrong
    argv = MODEL + ["--data-path", tiny_data, "--load", str(ckpt), "--micro-batch-size", "2", "--global-batch-size",
                    "4", "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1"]
    line = fails_with(capsys, argv)
    assert line.startswith(f"error: --load {ckpt}: "), line
    assert_refused_one_line(line, ckpt / tag / victim)
    assert not marker.exists() and not dist.is_initialized()


@pytest.mark.slow
def test_convert_refuses_a_tampered_checkpoint(real_checkpoint, tmp_path):
    ckpt, marker, out = tmp_path / "ckpt", tmp_path / "pwned", tmp_path / "out"
    shutil.copytree(real_checkpoint, ckpt)
    victim = ckpt / (ckpt / "latest").read_text().strip() / "mp_rank_00_model_states.pt"
    tamper(victim, marker)
    result = subprocess.run([sys.executable, str(CONVERT), "--load", str(ckpt), "--save", str(out)],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("convert_checkpoint.py: error: "), result.stderr
    assert_refused_one_line(last, victim)
    assert not marker.exists() and not out.exists()


# --- Hugging Face side of the converter ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def convert():
    spec = importlib.util.spec_from_file_location("convert_checkpoint_safe", CONVERT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_to_hf_writes_safetensors_and_reads_back(convert, tmp_path):
    config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, max_position_embeddings=64,
                         vocab_size=100, top_query_layer=False, activation="gelu_tanh")
    save_model_checkpoint(tmp_path / "ckpt", [CodeGeeXModel(config, None, None).state_dict()], config, 1)
    convert.main(["--load", str(tmp_path / "ckpt"), "--to-hf", str(tmp_path / "hf")])
    names = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert "model.safetensors" in names and not any(n.endswith((".bin", ".pt", ".pth")) for n in names), names
    convert.main(["--from-hf", str(tmp_path / "hf"), "--save", str(tmp_path / "back")])  # and it reads back
    assert read_checkpoint_meta(tmp_path / "back")[1]["model_config"]["hidden_size"] == 32


def test_from_hf_refuses_a_tampered_pytorch_model_bin(convert, tmp_path):
    from transformers import GPT2Config

    hf, marker = tmp_path / "hf", tmp_path / "pwned"
    GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=100, n_positions=64).save_pretrained(hf)
    torch.save({"transformer.wte.weight": torch.zeros(100, 32), "payload": TouchOnUnpickle(marker)},
               hf / "pytorch_model.bin")
    with pytest.raises(SystemExit) as exc:
        convert.main(["--from-hf", str(hf), "--save", str(tmp_path / "out")])
    assert exc.value.code.startswith("convert_checkpoint.py: error: refusing checkpoint file ")
    assert_refused_one_line(exc.value.code, hf / "pytorch_model.bin")
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_model_file_of_another_program_is_a_clear_error(tmp_path):
    (tmp_path / "iter_0000000").mkdir()
    (tmp_path / "latest").write_text("iter_0000000")
    torch.save({"state_dict": {"w": torch.ones(1)}}, tmp_path / "iter_0000000" / "mp_rank_00_model_states.pt")
    with pytest.raises(CheckpointError, match="is not a codegeex_train model file"):
        read_checkpoint_meta(tmp_path)
    (tmp_path / "latest").write_text("../elsewhere")
    with pytest.raises(CheckpointError, match="not a checkpoint tag"):
        read_checkpoint_meta(tmp_path)
