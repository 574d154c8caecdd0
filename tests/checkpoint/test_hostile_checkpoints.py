"""Checkpoint reads that cannot be turned against the reader, and saves that fail safely.

Each case is a real attempt whose success would be visible: a ``latest`` linked to a file of secrets (the secret
must not be printed), a file swapped between the preflight check and DeepSpeed's load (the payload must not run),
crafted ``universal.json`` and ZeRO files (one ``error:`` line each, no traceback), a symlinked tag directory and a
FIFO named ``*.pt`` (no walk, no hang), a Hugging Face index naming shards it should not, a too-old torch, and a
save into a full filesystem (one ``error:`` line, ``latest`` unchanged, no partial directory)."""

import errno
import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess

import pytest
import torch

from codegeex_train import pretrain
from codegeex_train.checkpoint import deepspeed_checkpoint as training_checkpoints
from codegeex_train.checkpoint.files import read_latest, write_latest
from codegeex_train.checkpoint.safe_load import (
    CheckpointError,
    UnsafeCheckpointError,
    safe_torch_load,
    verify_checkpoint_dir,
)
from codegeex_train.checkpoint.universal import FORMAT, read_universal_meta
from tests.harness import RankFailure, deadline, fails_with, run_distributed, tiny_model_args, tiny_pretrain_args

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODEL = tiny_model_args()
SECRET = "HF_TOKEN=hf_s3cr3t_d0_n0t_pr1nt_7f3a9"


class TouchOnUnpickle:
    """Unpickling this calls ``pathlib.Path.touch(marker)``: what a tampered checkpoint would run."""

    def __init__(self, marker):
        self.marker = pathlib.Path(marker)

    def __reduce__(self):
        return pathlib.Path.touch, (self.marker,)


def load_argv(data, load):
    return MODEL + ["--data-path", data, "--load", str(load), "--micro-batch-size", "2", "--global-batch-size", "8"]


# --- `latest` ------------------------------------------------------------------------------------------------

def test_latest_linked_to_secrets_is_refused_without_echoing_them(tmp_path, tiny_data, capsys):
    secrets = tmp_path / "environ"  # what /proc/self/environ holds: NUL-separated NAME=value pairs
    secrets.write_bytes(f"PATH=/usr/bin\0{SECRET}\0".encode())
    ckpt = tmp_path / "ckpt"
    (ckpt / "iter_0000001").mkdir(parents=True)
    (ckpt / "latest").symlink_to(secrets)
    line = fails_with(capsys, load_argv(tiny_data, ckpt), f"{ckpt}/latest", "symbolic link")
    assert "hf_s3cr3t" not in line
    # The same secrets as a regular file: not a tag, its size said, its content not.
    (ckpt / "latest").unlink()
    shutil.copy(secrets, ckpt / "latest")
    line = fails_with(capsys, load_argv(tiny_data, ckpt), "is not a checkpoint tag", f"{secrets.stat().st_size} bytes")
    assert "hf_s3cr3t" not in line and "PATH" not in line
    # Large, or a FIFO (never opened for a blocking read), or a directory.
    (ckpt / "latest").write_text("iter_" + "0" * 10_000)
    with pytest.raises(CheckpointError, match="is not a checkpoint tag"):
        read_latest(ckpt)
    (ckpt / "latest").unlink()
    os.mkfifo(ckpt / "latest")
    with deadline(10), pytest.raises(CheckpointError, match="is a FIFO, not a checkpoint tag"):
        read_latest(ckpt)


@pytest.mark.parametrize("tag", ["iter_0000123", "iter_12345678", "global_step5"])
def test_latest_accepts_the_tags_we_and_deepspeed_write(tmp_path, tag):
    (tmp_path / "latest").write_text(tag + "\n")
    assert read_latest(tmp_path) == tag
    write_latest(tmp_path, tag)
    assert read_latest(tmp_path) == tag and not (tmp_path / "latest.tmp").exists()


def test_write_latest_never_writes_through_a_planted_link(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    (tmp_path / "latest.tmp").symlink_to(victim)
    write_latest(tmp_path, "iter_0000002")
    assert victim.read_text() == "keep me" and read_latest(tmp_path) == "iter_0000002"
    with pytest.raises(ValueError):
        write_latest(tmp_path, "../x")


# --- tag directories and the files in them -----------------------------------------------------------------------

def test_symlinked_tag_directory_is_not_walked(tmp_path, tiny_data, capsys):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "iter_0000001").symlink_to("/")  # os.walk(followlinks=True) would walk the whole filesystem
    (ckpt / "latest").write_text("iter_0000001")
    with deadline(10):
        fails_with(capsys, load_argv(tiny_data, ckpt), "iter_0000001 is a symbolic link, not a directory")


def test_fifo_named_pt_is_never_opened(tmp_path, tiny_data, capsys):
    ckpt = tmp_path / "ckpt"
    (ckpt / "iter_0000001").mkdir(parents=True)
    (ckpt / "latest").write_text("iter_0000001")
    fifo = ckpt / "iter_0000001" / "mp_rank_00_model_states.pt"
    os.mkfifo(fifo)  # a plain open() of it would wait for a writer forever
    with deadline(10):
        fails_with(capsys, load_argv(tiny_data, ckpt), str(fifo), "is a FIFO, not a regular file")
        with pytest.raises(CheckpointError, match="it is a FIFO, not a regular file"):
            safe_torch_load(fifo)
    fifo.unlink()
    (ckpt / "iter_0000001" / "elsewhere.pt").symlink_to(tmp_path / "anything.pt")
    with pytest.raises(CheckpointError, match="elsewhere.pt is a symbolic link, not a regular file"):
        verify_checkpoint_dir(ckpt, "iter_0000001")


# --- torch itself ------------------------------------------------------------------------------------------------

def test_torch_with_known_weights_only_bypasses_is_refused(tmp_path, monkeypatch):
    torch.save({"w": torch.ones(2)}, tmp_path / "w.pt")
    monkeypatch.setattr(torch, "__version__", "2.9.1")
    with pytest.raises(UnsafeCheckpointError, match=r"torch 2\.9\.1 has known bypasses .*CVE-2026-24747.* torch >= "
                                                    r"2\.10"):
        safe_torch_load(tmp_path / "w.pt")
    monkeypatch.undo()
    assert torch.equal(safe_torch_load(tmp_path / "w.pt")["w"], torch.ones(2))
    from packaging.requirements import Requirement

    setup = (ROOT / "setup.py").read_text()
    floor = Requirement(re.search(r'"(torch>=[^"]+)"', setup).group(1))
    assert str(floor.specifier) == ">=2.10" and floor.specifier.contains(torch.__version__.split("+")[0])


# --- a real training checkpoint (one rank, DP 1) --------------------------------------------------------------------

def run_pretrain(topology, argv):
    pretrain.main(argv)


@pytest.fixture(scope="module")
def trained(tiny_data, tmp_path_factory):
    """A DeepSpeed ZeRO-2 training checkpoint of a 2-iteration run on one rank."""
    save = tmp_path_factory.mktemp("trained") / "ckpt"
    run_distributed(run_pretrain, world_size=1, deadline_s=300, argv=tiny_pretrain_args(tiny_data, str(save), 2))
    return save


def copy_of(trained, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(trained, ckpt)
    return ckpt, ckpt / read_latest(ckpt)


def swap_after_preflight(topology, argv, victim, payload):
    """A rank that runs pretrain.main, with the preflight (``prepare``: every check of ``--load``) followed at once
    by an attacker's swap of ``victim`` for ``payload`` (a file whose unpickling would touch a marker)."""
    checked = pretrain.prepare

    def check_then_swap(*args, **kwargs):
        prepared = checked(*args, **kwargs)
        os.replace(payload, victim)
        return prepared

    pretrain.prepare = check_then_swap
    pretrain.main(argv)


@pytest.mark.parametrize("victim", ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"])
def test_file_swapped_after_the_check_runs_nothing(trained, tiny_data, tmp_path, capfd, victim):
    ckpt, tag_dir = copy_of(trained, tmp_path)
    marker, payload = tmp_path / "pwned", tmp_path / "payload.pt"
    state = torch.load(tag_dir / victim, map_location="cpu", weights_only=False)  # ours: trusted
    state["payload"] = TouchOnUnpickle(marker)
    torch.save(state, payload)
    argv = tiny_pretrain_args(tiny_data, str(tmp_path / "out"), 4, "--lr-decay-iters", "2") + ["--load", str(ckpt)]
    with pytest.raises(RankFailure) as failure:
        run_distributed(swap_after_preflight, world_size=1, deadline_s=300, argv=argv, victim=str(tag_dir / victim),
                        payload=str(payload))
    assert not marker.exists()  # DeepSpeed's own load went through the weights-only loader too
    assert str(failure.value).count("CheckpointLoadError: --load") == 1
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err[-3000:]
    assert f"error: --load {ckpt} (iter_0000002): refusing checkpoint file {tag_dir / victim}: " in lines[0]
    assert "nothing in it was run" in lines[0]


def test_checkpoint_engine_loads_weights_only(tmp_path):
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    engine = training_checkpoints.SafeCheckpointEngine(TorchCheckpointEngine())
    marker = tmp_path / "pwned"
    torch.save({"w": torch.ones(2), "payload": TouchOnUnpickle(marker)}, tmp_path / "bad.pt")
    with pytest.raises(UnsafeCheckpointError, match="nothing in it was run"):
        engine.load(str(tmp_path / "bad.pt"), map_location=lambda storage, loc: storage)
    assert not marker.exists()
    engine.save({"w": torch.arange(3.0)}, str(tmp_path / "good.pt"))
    assert torch.equal(engine.load(str(tmp_path / "good.pt"), map_location="cpu")["w"], torch.arange(3.0))


# --- crafted ZeRO files ----------------------------------------------------------------------------------------

def _zero(osd_change):
    def change(state):
        osd_change(state["optimizer_state_dict"])
    return change


def _fragment_beyond(osd):
    name = next(iter(osd["param_slice_mappings"][0]))
    address = osd["param_slice_mappings"][0][name]
    address.start = osd["single_partition_of_fp32_groups"][0].numel() - address.numel + 1


def _short_moment(osd):
    osd["base_optimizer_state"]["state"][0]["exp_avg"] = torch.zeros(3)


ZERO = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
MODEL_FILE = "mp_rank_00_model_states.pt"
CRAFTED = {
    "zero-missing-optimizer_state_dict": (ZERO, lambda s: s.pop("optimizer_state_dict"),
                                          "lacks 'optimizer_state_dict'"),
    "zero-missing-param_slice_mappings": (ZERO, _zero(lambda o: o.pop("param_slice_mappings")),
                                          "lacks 'param_slice_mappings'"),
    "zero-fragment-out-of-range": (ZERO, _zero(_fragment_beyond), "beyond the group's partition of"),
    "zero-string-for-partition": (ZERO, _zero(lambda o: o.__setitem__("single_partition_of_fp32_groups", ["x"])),
                                  "'single_partition_of_fp32_groups' is a list, not a list of flat"),
    "zero-moment-of-wrong-size": (ZERO, _zero(_short_moment), "Adam exp_avg of parameter group 0 has 3 values"),
    "zero-clip-grad-string": (ZERO, _zero(lambda o: o.__setitem__("clip_grad", "1.0")),
                              "'clip_grad' is a str, not a number"),
    "model-missing-param_shapes": (MODEL_FILE, lambda s: s.pop("param_shapes"), "lacks 'param_shapes'"),
    "model-string-global_steps": (MODEL_FILE, lambda s: s.__setitem__("global_steps", "2"),
                                  "'global_steps' is a str, not an integer"),
}


@pytest.fixture(scope="module")
def convert():
    spec = importlib.util.spec_from_file_location("convert_checkpoint_hostile", ROOT / "tools" / "convert_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_crafted_deepspeed_files_are_one_error_line(trained, tiny_data, tmp_path, capsys, convert, monkeypatch, case):
    name, change, expected = CRAFTED[case]
    ckpt, tag_dir = copy_of(trained, tmp_path)
    state = torch.load(tag_dir / name, map_location="cpu", weights_only=False)
    change(state)
    torch.save(state, tag_dir / name)
    with pytest.raises(SystemExit) as exc:  # --to-universal reads every fragment address
        convert.main(["--load", str(ckpt), "--to-universal", str(tmp_path / "universal")])
    assert exc.value.code.startswith(f"convert_checkpoint.py: error: {tag_dir / name}: "), exc.value.code
    assert expected in exc.value.code and "\n" not in exc.value.code
    capsys.readouterr()
    monkeypatch.setenv("WORLD_SIZE", "1")  # --load at the layout it was saved at: only the crafted file is wrong
    fails_with(capsys, load_argv(tiny_data, ckpt), f"error: --load {ckpt}: {tag_dir / name}: ", expected)


# --- crafted universal.json ----------------------------------------------------------------------------------------

def universal_meta() -> dict:
    return {"format": FORMAT, "model_config": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
                                                "max_position_embeddings": 64, "vocab_size": 8192},
            "iteration": 2, "train_state": {"iteration": 2, "consumed_train_samples": 16, "wandb_run_id": None},
            "adam_step": 2, "lr_scheduler": {"num_steps": 2, "max_lr": 2e-3, "min_lr": 0.0, "decay_iters": 4,
                                             "warmup_iters": 2, "style": "cosine"},
            "global_steps": 2, "global_samples": 16, "skipped_steps": 0, "source_layout": {"tp": 1, "pp": 1, "dp": 2}}


def _set(path, value):
    def change(meta):
        *parents, key = path.split(".")
        for p in parents:
            meta = meta[p]
        meta[key] = value
    return change


def _drop(path):
    def change(meta):
        *parents, key = path.split(".")
        for p in parents:
            meta = meta[p]
        del meta[key]
    return change


UNIVERSAL_CASES = {
    "invalid-json": (None, "is not valid JSON ("),
    "not-an-object": (lambda m: [m], "the file is a list, not a JSON object"),
    "missing-key": (_drop("adam_step"), "the file lacks 'adam_step'"),
    "extra-key": (_set("surprise", 1), "the file has unknown keys 'surprise'"),
    "nested-missing": (_drop("train_state.consumed_train_samples"), "train_state lacks 'consumed_train_samples'"),
    "string-for-number": (_set("adam_step", "2"), "'adam_step' is a str, not an integer >= 0"),
    "bool-for-number": (_set("global_steps", True), "'global_steps' is a bool, not an integer >= 0"),
    "negative": (_set("skipped_steps", -1), "'skipped_steps' is an int, not an integer >= 0"),
    "wrong-type-object": (_set("lr_scheduler", [2]), "lr_scheduler is a list, not a JSON object"),
    "string-in-lr-schedule": (_set("lr_scheduler.num_steps", "2"), "'lr_scheduler.num_steps' is a str"),
    "model-field-string": (_set("model_config.hidden_size", "32"), "model_config field 'hidden_size' is a str, not int"),
    "model-unknown-field": (_set("model_config.evil", 1), "'model_config' has an unknown field 'evil'"),
    "model-invalid": (_set("model_config.num_attention_heads", 5), "its model_config is not a valid model"),
    "wrong-format": (_set("format", "other/9"), "unknown universal checkpoint format 'other/9'"),
}


@pytest.mark.parametrize("case", sorted(UNIVERSAL_CASES))
def test_crafted_universal_json_is_one_error_line(tmp_path, tiny_data, capsys, case):
    change, expected = UNIVERSAL_CASES[case]
    ckpt, tag = tmp_path / "universal", "iter_0000002"
    (ckpt / tag).mkdir(parents=True)
    write_latest(ckpt, tag)
    for state in ("fp32", "exp_avg", "exp_avg_sq"):
        (ckpt / tag / f"{state}.safetensors").write_bytes(b"")  # only their kind is checked before the ranks
    meta = universal_meta()
    path = ckpt / tag / "universal.json"
    path.write_text(json.dumps(meta))
    assert read_universal_meta(ckpt, tag) == meta  # the uncrafted file passes
    if change is None:
        path.write_text(json.dumps(meta)[:-7])
    else:
        meta = change(meta) or meta
        path.write_text(json.dumps(meta))
    fails_with(capsys, load_argv(tiny_data, ckpt), f"error: --load {ckpt}: ", expected)


def test_crafted_universal_tensors_are_one_error_line(tmp_path, tiny_data, capsys):
    from safetensors.torch import save_file

    ckpt, tag = tmp_path / "universal", "iter_0000002"
    (ckpt / tag).mkdir(parents=True)
    write_latest(ckpt, tag)
    (ckpt / tag / "universal.json").write_text(json.dumps(universal_meta()))
    for state in ("fp32", "exp_avg", "exp_avg_sq"):
        save_file({"w": torch.zeros(2, 3)}, str(ckpt / tag / f"{state}.safetensors"))
    (ckpt / tag / "exp_avg.safetensors").write_bytes(b"\xff" * 64)
    fails_with(capsys, load_argv(tiny_data, ckpt), "exp_avg.safetensors is not a readable safetensors file")
    save_file({"w": torch.zeros(3, 2)}, str(ckpt / tag / "exp_avg.safetensors"))
    fails_with(capsys, load_argv(tiny_data, ckpt), "exp_avg.safetensors and fp32.safetensors hold different "
                                                   "tensors (e.g. w)")


def test_universal_json_and_tensors_must_be_regular_files(tmp_path):
    ckpt, tag = tmp_path / "universal", "iter_0000002"
    (ckpt / tag).mkdir(parents=True)
    (tmp_path / "meta.json").write_text(json.dumps(universal_meta()))
    (ckpt / tag / "universal.json").symlink_to(tmp_path / "meta.json")
    with pytest.raises(CheckpointError, match="universal.json is a symbolic link"):
        read_universal_meta(ckpt, tag)
    (ckpt / tag / "universal.json").unlink()
    shutil.copy(tmp_path / "meta.json", ckpt / tag / "universal.json")
    os.mkfifo(ckpt / tag / "fp32.safetensors")
    with deadline(10), pytest.raises(CheckpointError, match="is missing|is a FIFO"):
        read_universal_meta(ckpt, tag)


# --- --from-hf: every shard its index names ------------------------------------------------------------------------

@pytest.fixture
def hf_dir(tmp_path):
    from transformers import GPT2Config

    hf = tmp_path / "hf"
    GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=100, n_positions=64).save_pretrained(hf)
    return hf


def _index(hf, *shards, name="pytorch_model.bin.index.json"):
    weight_map = {f"transformer.h.{i}.weight": shard for i, shard in enumerate(shards)}
    (hf / name).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_from_hf_checks_every_shard_its_index_names(convert, hf_dir, tmp_path):
    marker, out = tmp_path / "pwned", tmp_path / "out"

    def refused(*fragments):
        with pytest.raises(SystemExit) as exc:
            convert.main(["--from-hf", str(hf_dir), "--save", str(out)])
        assert exc.value.code.startswith("convert_checkpoint.py: error: ") and "\n" not in exc.value.code
        for fragment in fragments:
            assert fragment in exc.value.code, exc.value.code
        assert not marker.exists() and not out.exists()

    # A pickled shard under a name no glob looks for, named only by the index: checked all the same.
    torch.save({"w": torch.zeros(2), "payload": TouchOnUnpickle(marker)}, hf_dir / "shard-1.pickle")
    _index(hf_dir, "shard-1.pickle")
    refused(f"refusing checkpoint file {hf_dir / 'shard-1.pickle'}")
    (hf_dir / "shard-1.pickle").unlink()
    torch.save({"w": torch.zeros(2), "payload": TouchOnUnpickle(marker)}, tmp_path / "outside.bin")
    _index(hf_dir, "../outside.bin")
    refused("names the shard '../outside.bin', which is not a file name inside")
    _index(hf_dir, "missing.bin")
    refused(f"shard named by pytorch_model.bin.index.json: {hf_dir / 'missing.bin'}: No such file")
    os.mkfifo(hf_dir / "fifo.safetensors")
    _index(hf_dir, "fifo.safetensors", name="model.safetensors.index.json")
    with deadline(20):
        refused(f"{hf_dir / 'fifo.safetensors'} is a FIFO, not a regular file")
    (hf_dir / "fifo.safetensors").unlink()
    (hf_dir / "model.safetensors.index.json").write_text("{not json")
    (hf_dir / "pytorch_model.bin.index.json").unlink()
    refused("model.safetensors.index.json is not a weights index")


# --- saves that fail --------------------------------------------------------------------------------------------------

def test_failed_write_is_recorded_and_the_partial_file_removed(tmp_path, monkeypatch):
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    inner = TorchCheckpointEngine()
    inner.zipfile_serialization = True  # DeepSpeed's default (checkpoint.checkpoint_serialization)
    engine = training_checkpoints.SafeCheckpointEngine(inner)
    monkeypatch.setattr(training_checkpoints.SafeCheckpointEngine, "_open", full_disk_open(lambda path: True))
    engine.save({"w": torch.zeros(100_000)}, str(tmp_path / "a.pt"))
    assert engine.failure == (str(tmp_path / "a.pt"), "No space left on device")
    assert not (tmp_path / "a.pt").exists()
    engine.save({"w": torch.zeros(1)}, str(tmp_path / "b.pt"))  # nothing more is written on a failed rank
    assert not (tmp_path / "b.pt").exists() and engine.take_failure() is not None and engine.failure is None


class _FullDisk:
    """A file whose writes fail with ENOSPC once ``room`` bytes are in: a disk filling up mid-file."""

    def __init__(self, path, room=4096):
        self.file, self.room = open(path, "wb"), room

    def write(self, data):
        if self.file.tell() + len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.file.write(data)

    def __getattr__(self, name):
        return getattr(self.file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()


def full_disk_open(fails):
    def _open(self, path):
        return _FullDisk(path) if fails(path) else open(path, "wb")
    return _open


def pretrain_with_full_disk(topology, argv, rank, tag):
    """A rank of pretrain.main on which rank ``rank``'s ZeRO file of ``tag`` hits a full disk."""
    if topology.rank == rank:
        training_checkpoints.SafeCheckpointEngine._open = full_disk_open(
            lambda path: f"/{tag}/" in path and path.endswith("optim_states.pt"))
    pretrain.main(argv)


def assert_failed_save(capfd, failure, save, world):
    text = str(failure.value)
    assert "did not finish" not in text and text.count("CheckpointSaveError: could not save") == world, text
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err[-3000:]
    assert lines[0].startswith(f"error: could not save checkpoint iter_0000004 to {save}: rank "), lines[0]
    assert ": No space left on device; removed the partial " in lines[0], lines[0]
    assert (f"'latest' is unchanged: the last complete checkpoint is iter_0000002 in {save} (relaunch with --load "
            f"{save} to resume from it)") in lines[0]
    assert "Traceback" not in err and "basic_ios" not in err
    assert read_latest(save) == "iter_0000002"
    assert sorted(p.name for p in pathlib.Path(save).iterdir() if p.name.startswith("iter_")) == ["iter_0000002"]
    assert not (pathlib.Path(save) / "latest.tmp").exists()


def test_save_into_a_full_disk_injected_on_one_rank(tiny_data, tmp_path, capfd):
    save = str(tmp_path / "run")
    argv = tiny_pretrain_args(tiny_data, save, 4, "--save-interval", "2")
    with pytest.raises(RankFailure) as failure:
        run_distributed(pretrain_with_full_disk, world_size=2, deadline_s=300, argv=argv, rank=1, tag="iter_0000004")
    assert_failed_save(capfd, failure, save, world=2)
    assert "rank 1 could not write" in str(failure.value)


@pytest.fixture
def small_tmpfs(tmp_path, trained):
    """A tmpfs with room for one checkpoint of ``trained``'s run and half another (needs root and mount)."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    size = sum(p.stat().st_size for p in trained.rglob("*") if p.is_file())
    kib = (size * 3 // 2) // 1024 + 64
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(mount)], capture_output=True,
                            text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({' '.join(result.stderr.split()) or result.returncode}); the "
                    f"injected full disk test covers the same path")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_save_into_a_real_full_filesystem(small_tmpfs, tiny_data, capfd):
    save = str(small_tmpfs / "run")
    argv = tiny_pretrain_args(tiny_data, save, 4, "--save-interval", "2")
    with pytest.raises(RankFailure) as failure:
        run_distributed(run_pretrain, world_size=1, deadline_s=300, argv=argv)
    assert_failed_save(capfd, failure, save, world=1)
