"""What ``--load`` restores: --finetune (model weights only, from a training, universal or weights-only checkpoint;
a relaunch resumes from --save), --no-load-optim (all but the optimizer: ZeRO-2's fp32 masters rebuilt from the
loaded weights) and --no-load-rng (all but the RNG streams). Each run is ``pretrain.main`` on real gloo ranks; a
wrapper around ``restore`` records what the run starts from (counters, weights, ZeRO's fp32 masters, Adam's state,
the RNG states) before the first step."""

from __future__ import annotations

import contextlib
import io
import shutil

import numpy as np
import pytest
import torch

from codegeex_train import pretrain
from codegeex_train.checkpoint.files import load_full_state_dict
from codegeex_train.checkpoint.resume import ResumeKind, preflight_resume
from codegeex_train.checkpoint.safe_load import safe_torch_load
from codegeex_train.config.arguments import ConfigError
from codegeex_train.config.model_config import ModelConfig
from codegeex_train.layout.dims import ParallelDims
from tests.harness import checkpoint_at, fails_with, load_tool, metrics_records, run_distributed, tiny_pretrain_args

ITERS, SAVED_AT = 6, 4  # the pretraining run, and the checkpoint the others start from
BATCH = 8  # tiny_pretrain_args' global batch
DROPOUT = ("--hidden-dropout", "0.1")  # training draws from the RNG streams: a checkpoint's differ from --seed's


def observed_pretrain(topology, argv: list[str]) -> dict:
    """``pretrain.main(argv)`` on this rank, recording what ``restore`` hands the training loop, and stdout."""
    from deepspeed.utils import safe_get_full_fp32_param

    real_restore = pretrain.restore
    seen: dict = {}

    def restore(resume, model, topo, tracker, *args, **kwargs):
        engine, state = real_restore(resume, model, topo, tracker, *args, **kwargs)
        params = dict(engine.module.named_parameters())
        seen.update(
            iteration=state.iteration, consumed=state.consumed_train_samples,
            weights={n: p.detach().clone() for n, p in params.items()},
            # A collective over the DP group (every rank, same order): this rank's slice of ZeRO's fp32 masters,
            # all-reduced into the whole parameter.
            masters={n: safe_get_full_fp32_param(p).clone() for n, p in params.items()},
            adam_states=len(engine.optimizer.optimizer.state),  # ZeRO's wrapped AdamW: empty until its first step
            lr=engine.get_lr()[0], cpu_rng=torch.get_rng_state().clone(), tracker_rng=tracker.get_states())
        return engine, state

    pretrain.restore = restore
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            pretrain.main(argv)
    finally:
        pretrain.restore = real_restore
    seen["stdout"] = out.getvalue()
    return seen


def train(data, save, world: int, *extra: str) -> list[dict]:
    return run_distributed(observed_pretrain, world_size=world, deadline_s=600,
                           argv=tiny_pretrain_args(data, str(save), ITERS, *DROPOUT, *extra))


def adam_step(save, tag: str) -> int:
    """Adam's step count in DP rank 0's ZeRO partition file of checkpoint ``tag``."""
    osd = safe_torch_load(save / tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
    steps = {int(s["step"]) for s in osd["base_optimizer_state"]["state"].values()}
    assert len(steps) == 1, steps
    return steps.pop()


def assert_same_tensors(actual: dict, expected: dict, what: str) -> None:
    assert sorted(actual) == sorted(expected), what
    for name in expected:
        np.testing.assert_array_equal(np.asarray(actual[name]), np.asarray(expected[name]), err_msg=f"{what}: {name}")


def equal_rng(a: dict, b: dict) -> bool:
    return (np.array_equal(a["cpu_rng"], b["cpu_rng"]) and sorted(a["tracker_rng"]) == sorted(b["tracker_rng"])
            and all(np.array_equal(a["tracker_rng"][k], b["tracker_rng"][k]) for k in a["tracker_rng"]))


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, tiny_data) -> dict:
    """A fresh run at DP 2 (ITERS iterations, saving every 2) observed at its start; a copy whose ``latest`` is
    iteration SAVED_AT; that checkpoint converted to universal and to weights only; its weights."""
    root = tmp_path_factory.mktemp("finetune")
    full = root / "pretrained"
    seen = train(tiny_data, full, 2, "--save-interval", "2")
    at_save = root / "at_save"
    checkpoint_at(full, at_save, SAVED_AT)
    convert = load_tool("convert_checkpoint")
    convert.main(["--load", str(at_save), "--to-universal", str(root / "universal")])
    convert.main(["--load", str(at_save), "--save", str(root / "weights")])
    weights, _, meta = load_full_state_dict(at_save)
    return {"root": root, "full": full, "seen": seen, "records": metrics_records(full), "weights": weights,
            "meta": meta, "dirs": {"training": at_save, "universal": root / "universal", "weights": root / "weights"}}


@pytest.fixture(scope="module")
def finetuned(pretrained, tiny_data):
    """``finetuned(kind)``: --finetune from that kind of checkpoint at DP 1 (the training one was saved at DP 2),
    stopped after two iterations (saved then: what a relaunch resumes); each run once per module."""
    runs: dict = {}

    def run(kind: str) -> dict:
        if kind not in runs:
            save = pretrained["root"] / f"finetuned_{kind}"
            [seen] = train(tiny_data, save, 1, "--load", str(pretrained["dirs"][kind]), "--finetune",
                           "--exit-interval", "2")
            runs[kind] = {"save": save, "seen": seen, "records": metrics_records(save)}
        return runs[kind]

    return run


def test_the_checkpoints_are_of_each_kind(pretrained):
    dims = ParallelDims(2, 1, 1)
    config = ModelConfig(**pretrained["meta"]["model_config"])
    kinds = {kind: preflight_resume(str(d), config, dims).kind for kind, d in pretrained["dirs"].items()}
    assert kinds == {"training": ResumeKind.TRAINING, "universal": ResumeKind.UNIVERSAL, "weights": ResumeKind.WEIGHTS}
    assert pretrained["meta"]["iteration"] == SAVED_AT


# The fast tier (tests/conftest.py) keeps one case of each feature: the training checkpoint's here.
@pytest.mark.parametrize("kind", ["training", pytest.param("universal", marks=pytest.mark.slow),
                                  pytest.param("weights", marks=pytest.mark.slow)])
def test_finetune_starts_a_fresh_run_from_the_weights(pretrained, finetuned, kind):
    run, fresh = finetuned(kind), pretrained["seen"][0]
    seen = run["seen"]
    assert (seen["iteration"], seen["consumed"]) == (0, 0)
    assert_same_tensors(seen["weights"], pretrained["weights"], "weights at start vs the checkpoint's")
    assert_same_tensors(seen["masters"], pretrained["weights"], "ZeRO's fp32 masters at start vs the checkpoint's")
    assert seen["adam_states"] == 0  # a fresh optimizer
    assert equal_rng(seen, fresh)  # the RNG streams as --seed makes them, not the checkpoint's
    records, fresh_records = run["records"], pretrained["records"]
    assert sorted(records) == [1, 2]
    for it in (1, 2):  # the LR schedule and data position of a fresh run
        assert records[it]["lr"] == fresh_records[it]["lr"]
        assert records[it]["consumed_samples"] == BATCH * it
    assert adam_step(run["save"], "iter_0000002") == 2  # Adam's step count started at 1
    # It starts from trained weights: a lower loss than the fresh run on the same first batches.
    assert records[1]["loss"] < fresh_records[1]["loss"] - 0.1


def test_relaunching_a_finetune_resumes_from_save(pretrained, finetuned, tiny_data):
    first = finetuned("training")
    save = pretrained["root"] / "relaunched"
    shutil.copytree(first["save"], save)  # the first launch's --save (a copy: the fixture's stays as it was)
    [seen] = train(tiny_data, save, 1, "--load", str(pretrained["dirs"]["training"]), "--finetune",
                   "--exit-interval", "2")
    notes = [line for line in seen["stdout"].splitlines() if line.startswith(f"--save {save} holds a run")]
    assert notes == [f"--save {save} holds a run (iter_0000002): resuming it instead of starting over from --load "
                     f"{pretrained['dirs']['training']} (this run saved before it stopped); --start-over starts a new "
                     f"run there instead"]
    assert (seen["iteration"], seen["consumed"]) == (2, 2 * BATCH)
    assert seen["adam_states"] > 0  # the fine-tuning run's own optimizer state
    saved, _, _ = load_full_state_dict(first["save"])
    assert_same_tensors(seen["weights"], saved, "weights at the relaunch vs the fine-tuning run's checkpoint")
    records = metrics_records(save)
    assert sorted(records) == [1, 2, 3, 4]  # 1, 2 from the first launch (metrics.jsonl is appended to)
    for it in (3, 4):
        assert records[it]["lr"] == pretrained["records"][it]["lr"]  # the fine-tuning run's schedule continues
        assert records[it]["consumed_samples"] == BATCH * it
    assert adam_step(save, "iter_0000004") == 4


@pytest.mark.slow
@pytest.mark.parametrize("kind, world", [
    pytest.param("training", 2, id="training_dp2"),
    pytest.param("training", 1, id="training_saved_at_dp2_loaded_at_dp1"),
    pytest.param("universal", 2, id="universal_dp2"),
])
def test_no_load_optim_restores_all_but_the_optimizer(pretrained, tiny_data, kind, world):
    save = pretrained["root"] / f"no_load_optim_{kind}_dp{world}"
    seen = train(tiny_data, save, world, "--load", str(pretrained["dirs"][kind]), "--no-load-optim",
                 "--save-interval", "5")
    reference = pretrained["records"]
    saved_rng = {"cpu_rng": pretrained["meta"]["train_state"]["rng"]["cpu"],
                 "tracker_rng": pretrained["meta"]["train_state"]["rng"]["tracker"]}
    for rank, fresh in zip(seen, pretrained["seen"]):
        assert (rank["iteration"], rank["consumed"]) == (SAVED_AT, SAVED_AT * BATCH)
        assert_same_tensors(rank["weights"], pretrained["weights"], "weights at start vs the checkpoint's")
        # ZeRO-2's fp32 master partitions (at DP 2 each rank holds half) were rebuilt from the loaded weights.
        assert_same_tensors(rank["masters"], pretrained["weights"], "ZeRO's fp32 masters vs the loaded weights")
        assert rank["adam_states"] == 0
        # Restored from a training checkpoint (only --no-load-rng leaves them); a universal one holds none.
        assert equal_rng(rank, saved_rng if kind == "training" else fresh)
    records = metrics_records(save)
    assert sorted(records) == [5, 6]
    for it in (5, 6):  # the LR schedule and the data position continue
        assert records[it]["lr"] == reference[it]["lr"]
        assert records[it]["consumed_samples"] == reference[it]["consumed_samples"]
    if (kind, world) == ("training", 2):  # step 5's forward saw the uninterrupted run's weights, batch and dropout
        assert records[5]["loss"] == pytest.approx(reference[5]["loss"], rel=1e-6)  # masks (those differ by layout)
    # Its update came from a fresh Adam (the moments of 4 steps would have given the uninterrupted run's).
    assert records[6]["loss"] != pytest.approx(reference[6]["loss"], rel=1e-6)
    assert adam_step(save, "iter_0000005") == 1


@pytest.mark.slow
def test_no_load_rng_restores_all_but_the_rng(pretrained, tiny_data):
    save = pretrained["root"] / "no_load_rng"
    seen = train(tiny_data, save, 2, "--load", str(pretrained["dirs"]["training"]), "--no-load-rng",
                 "--exit-interval", "1")
    for rank, fresh in zip(seen, pretrained["seen"]):
        assert (rank["iteration"], rank["consumed"]) == (SAVED_AT, SAVED_AT * BATCH)
        assert rank["adam_states"] > 0  # the optimizer state was loaded
        assert equal_rng(rank, fresh)  # the streams as --seed makes them
    saved_rng = {"cpu_rng": pretrained["meta"]["train_state"]["rng"]["cpu"],
                 "tracker_rng": pretrained["meta"]["train_state"]["rng"]["tracker"]}
    assert not equal_rng(seen[0], saved_rng)  # (so the check above can tell)
    # Same weights, optimizer and batch as the uninterrupted run's iteration 5, other dropout masks.
    resumed, reference = metrics_records(save)[5], pretrained["records"][5]
    assert resumed["consumed_samples"] == reference["consumed_samples"] and resumed["lr"] == reference["lr"]
    assert resumed["loss"] != pytest.approx(reference["loss"], rel=1e-6)


def test_only_the_optimizer_files_pin_the_dp_size(pretrained):
    """A training checkpoint saved at DP 2 loads at DP 1 when its ZeRO partitions are not read."""
    config = ModelConfig(**pretrained["meta"]["model_config"])
    load, dp1 = str(pretrained["dirs"]["training"]), ParallelDims(1, 1, 1)
    with pytest.raises(ConfigError, match=r"DP 2 \(this run 1\)"):
        preflight_resume(load, config, dp1)
    assert preflight_resume(load, config, dp1, load_optim=False).load_optim is False
    assert preflight_resume(load, config, dp1, finetune=True).finetune is True
    with pytest.raises(ConfigError, match=r"TP 1 \(this run 2\)"):  # the model files still pin TP and PP
        preflight_resume(load, config, ParallelDims(2, 2, 1), finetune=True)


@pytest.mark.parametrize("extra, message", [
    (["--finetune"], "--finetune without --load"),
    (["--no-load-optim", "--no-load-rng"], "--no-load-optim --no-load-rng without --load"),
    (["--finetune", "--load", "{save}"], "--finetune with --save {save} equal to --load"),
], ids=["finetune_without_load", "no_load_flags_without_load", "finetune_into_its_load_dir"])
def test_nonsense_combinations_are_one_error_line(tmp_path, tiny_data, capsys, monkeypatch, extra, message):
    monkeypatch.setenv("WORLD_SIZE", "1")
    save = tmp_path / "save"
    save.mkdir()
    fails_with(capsys, tiny_pretrain_args(tiny_data, str(save), 2, *(a.format(save=save) for a in extra)),
               message.format(save=save))

