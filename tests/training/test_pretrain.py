"""End-to-end pretraining under DeepSpeed ZeRO-2 on real gloo ranks: parity across TP/DP, exact resume (and which
rank logs what), crash-safe checkpoints and activation recomputation. Each run calls ``pretrain.main`` in spawned
ranks."""

import os
import re
import shutil

import pytest
import torch

from codegeex_train import pretrain
from codegeex_train.checkpoint.files import read_latest, write_latest
from tests.harness import (
    RankFailure,
    metrics_records,
    read_metrics,
    run_distributed,
    run_pretrain,
    tiny_pretrain_args,
)

ITERS = 20


def train(tmp_path, data, name, world, tp, *extra, iters=ITERS):
    save = str(tmp_path / name)
    run_distributed(run_pretrain, world_size=world, tp_size=tp, deadline_s=600,
                    argv=tiny_pretrain_args(data, save, iters, *extra))
    return save


@pytest.mark.slow
def test_losses_agree_across_tp_and_dp(tmp_path, tiny_data):
    # The same global batch of 8 sequences: (1,1) takes 4 micro-batches, (1,2) and (2,2) two per DP rank.
    runs = {(tp, dp): metrics_records(train(tmp_path, tiny_data, f"tp{tp}dp{dp}", tp * dp, tp))
            for tp, dp in [(1, 1), (2, 1), (1, 2), (2, 2)]}
    base = runs[(1, 1)]
    assert sorted(base) == list(range(1, ITERS + 1))
    assert base[ITERS]["loss"] < base[1]["loss"]  # it learns
    for key, run in runs.items():
        for it in range(1, ITERS + 1):
            assert run[it]["loss"] == pytest.approx(base[it]["loss"], rel=1e-4), (key, it)
            assert run[it]["grad_norm"] == pytest.approx(base[it]["grad_norm"], rel=1e-4), (key, it)
            assert run[it]["lr"] == pytest.approx(base[it]["lr"], rel=1e-12)


@pytest.mark.slow
def test_clip_grad_really_clips(tmp_path, tiny_data):
    # Plain SGD, so the update is proportional to the (clipped) gradient; Adam would normalise it away.
    sgd = ["--optimizer", "sgd", "--sgd-momentum", "0", "--lr", "1.0", "--lr-warmup-iters", "0",
           "--lr-decay-style", "constant"]
    unclipped = metrics_records(train(tmp_path, tiny_data, "noclip", 2, 2, *sgd, "--clip-grad", "0", iters=2))
    clipped = metrics_records(train(tmp_path, tiny_data, "clip", 2, 2, *sgd, "--clip-grad", "0.05", iters=2))
    assert clipped[1]["grad_norm"] == pytest.approx(unclipped[1]["grad_norm"], rel=1e-5)  # reported before clipping
    assert clipped[1]["grad_norm"] > 1.0
    # The first step was shrunk by norm / 0.05 > 20x, so iteration 2 starts from different weights.
    assert unclipped[2]["loss"] != pytest.approx(clipped[2]["loss"], rel=1e-3)


def test_resume_is_exact(tmp_path, tiny_data, capfd):
    # DP 2 so ZeRO-2 partitions the optimizer states that must come back.
    full = train(tmp_path, tiny_data, "full", 2, 1, "--save-interval", "5", iters=10)
    full_out = capfd.readouterr().out
    resumed = str(tmp_path / "resumed")
    shutil.copytree(full, resumed)
    os.remove(os.path.join(resumed, "metrics.jsonl"))
    write_latest(resumed, "iter_0000005")
    run_distributed(run_pretrain, world_size=2, tp_size=1, deadline_s=600,
                    argv=tiny_pretrain_args(tiny_data, resumed, 10, "--load", resumed, "--save-interval", "5",
                                            "--log-all-ranks"))
    resumed_out = capfd.readouterr().out
    a, b = metrics_records(full), metrics_records(resumed)
    assert sorted(b) == list(range(6, 11))
    for it in range(6, 11):
        for key in ("loss", "lr", "grad_norm"):
            assert b[it][key] == pytest.approx(a[it][key], rel=1e-6, abs=1e-9), (it, key)
        assert b[it]["consumed_samples"] == a[it]["consumed_samples"] == 8 * it
    # Console logging (distributed/log.py): by default rank 0 alone says its info lines, bare; --log-all-ranks has
    # each rank say them, prefixed. The per-iteration line is the metrics logger's: once, bare, either way.
    def summary_prefixes(out: str) -> list[str]:  # of the model summary's first line, each time it is said
        return sorted(m.group(1) or "" for line in out.splitlines()
                      if (m := re.match(r"(\[rank \d\] )?model: 2 layers", line)))

    assert summary_prefixes(full_out) == [""] and "[rank " not in full_out
    assert summary_prefixes(resumed_out) == ["[rank 0] ", "[rank 1] "]
    for out in (full_out, resumed_out):
        [last] = [line for line in out.splitlines() if "iteration       10/      10" in line]
        assert last.startswith(" iteration       10/      10 | ")


CRASH_EXIT_CODE = 13  # what the injected crash exits with: the harness must see this one, not another failure


def crash_during_second_save(topology, argv):
    real_save = torch.save

    def save(obj, path, *args, **kwargs):
        if "iter_0000004" in str(path):
            os._exit(CRASH_EXIT_CODE)  # killed while writing the second checkpoint
        return real_save(obj, path, *args, **kwargs)

    torch.save = save
    pretrain.main(argv)


@pytest.mark.slow
def test_crash_mid_checkpoint_keeps_previous_latest(tmp_path, tiny_data):
    save = str(tmp_path / "crash")
    with pytest.raises(RankFailure, match=f"process exited with code {CRASH_EXIT_CODE} without reporting"):
        run_distributed(crash_during_second_save, world_size=2, tp_size=2, deadline_s=600,
                        argv=tiny_pretrain_args(tiny_data, save, 4, "--save-interval", "2"))
    assert read_latest(save) == "iter_0000002"
    crashed_lines = len(read_metrics(save))  # metrics.jsonl is appended to: what follows is the resumed run's
    resumed = train(tmp_path, tiny_data, "crash", 2, 2, "--load", save, "--save-interval", "2", iters=4)
    after = [r for r in read_metrics(resumed)[crashed_lines:] if r.get("split", "train") == "train"]
    # It restarted from the last complete checkpoint (2), at its data position, and ran to the end.
    assert [r["iteration"] for r in after] == [3, 4]
    assert after[0]["consumed_samples"] == 8 * 3
    assert read_latest(save) == "iter_0000004"


@pytest.mark.slow
def test_checkpoint_activations_same_losses(tmp_path, tiny_data):
    dropout = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
    plain = metrics_records(train(tmp_path, tiny_data, "plain", 2, 2, *dropout, iters=4))
    recompute = metrics_records(train(tmp_path, tiny_data, "recompute", 2, 2, *dropout, "--checkpoint-activations",
                                      iters=4))
    for it in range(1, 5):
        assert recompute[it]["loss"] == pytest.approx(plain[it]["loss"], rel=1e-6)
        assert recompute[it]["grad_norm"] == pytest.approx(plain[it]["grad_norm"], rel=1e-6)


@pytest.mark.slow
def test_wandb_offline_run_matches_metrics_file(tmp_path, tiny_data, monkeypatch):
    from codegeex_train.metrics import read_offline_wandb_history

    monkeypatch.setenv("WANDB_MODE", "offline")
    wandb_dir = tmp_path / "wb"
    wandb = ["--wandb-project", "codegeex-test", "--wandb-name", "tiny", "--wandb-dir", str(wandb_dir)]
    save = train(tmp_path, tiny_data, "wandb", 1, 1, *wandb, iters=2)
    logged = metrics_records(save)
    runs = sorted((wandb_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    history = {row["_step"]: row for row in read_offline_wandb_history(runs[0])}
    for it in (1, 2):
        for key in ("loss", "lr", "grad_norm", "tokens_per_s", "consumed_samples"):
            assert history[it][f"train/{key}"] == pytest.approx(logged[it][key], rel=1e-12), (it, key)
    assert history[2]["test/loss"] == pytest.approx(metrics_records(save, "test")[2]["test_loss"], rel=1e-12)

    # A resumed run continues the same wandb run: the id travels in the checkpoint.
    train(tmp_path, tiny_data, "wandb", 1, 1, *wandb, "--load", save, "--lr-decay-iters", "2", iters=3)
    resumed = sorted((wandb_dir / "wandb").glob("offline-run-*"))
    assert len(resumed) == 2 and len({r.name.split("-")[3] for r in resumed}) == 1, resumed
