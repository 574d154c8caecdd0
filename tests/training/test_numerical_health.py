"""Numerical health: a NaN or Inf in the loss or the gradient norm stops every rank at the same iteration with one
message naming it and the last good checkpoint, without saving; fp16's skipped steps are counted and a long run of
them stops the run. Bad numbers are injected through ``CODEGEEX_TRAIN_TEST_INJECT`` (training/fault_injection.py, tests only); fp16
itself is refused on CPU, so its skips are real DeepSpeed skips of inf gradients judged with fp16's rules."""

import math
import os

import pytest
import torch

from codegeex_train import pretrain
from codegeex_train.checkpoint.files import read_latest
from codegeex_train.checkpoint.manager import CheckpointManager
from codegeex_train.config.arguments import ConfigError, parse_args, validate
from tests.harness import RankFailure, metrics_records, run_distributed, run_pretrain, tiny_pretrain_args
from codegeex_train.training import fault_injection, trainer
from codegeex_train.training.exit_conditions import ExitConditions, NumericalHealth, NumericalHealthError

INJECT = fault_injection.TEST_INJECT_ENV


def failed_run(monkeypatch, tmp_path, data, inject, world, tp=1, pp=1, iters=8, *extra, fn=run_pretrain):
    """Run to the failure; returns (save dir, the RankFailure's text)."""
    save = str(tmp_path / "run")
    monkeypatch.setenv(INJECT, inject)  # the spawned ranks inherit it
    sizes = [] if pp == 1 else ["--pipeline-model-parallel-size", str(pp)]
    sizes += [] if tp == 1 else ["--tensor-model-parallel-size", str(tp)]
    with pytest.raises(RankFailure) as failure:
        run_distributed(fn, world_size=world, tp_size=tp, pp_size=pp, deadline_s=600,
                        argv=tiny_pretrain_args(data, save, iters, *sizes, *extra))
    text = str(failure.value)
    assert "did not finish" not in text  # every rank stopped; none hung in a collective
    assert text.count("NumericalHealthError") == world, text  # all ranks, the same error
    return save, text


def assert_one_error_line(capfd, expected: str) -> None:
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and expected in lines[0], err[-3000:]


def test_nan_loss_stops_every_stage_without_saving(monkeypatch, tmp_path, tiny_data, capfd):
    # PP 2: the loss lives on the last stage only; the first stage must stop at the same iteration.
    save, text = failed_run(monkeypatch, tmp_path, tiny_data, "nan-loss@5", 2, 1, 2, 8, "--save-interval", "2")
    message = ("the loss and the gradient norm are NaN or Inf at iteration 5; stopped at iteration 5 without saving "
               f"it. Last good checkpoint: iter_0000004 in {save}")
    assert message in text
    assert_one_error_line(capfd, message)
    assert read_latest(save) == "iter_0000004"
    assert not os.path.exists(os.path.join(save, "iter_0000005"))
    rows = metrics_records(save)
    assert sorted(rows) == [1, 2, 3, 4, 5]  # the bad iteration is logged, then nothing
    assert math.isnan(rows[5]["loss"]) and all(math.isfinite(rows[i]["loss"]) for i in range(1, 5))


@pytest.mark.slow
def test_inf_grad_norm_stops_dp_ranks(monkeypatch, tmp_path, tiny_data):
    save, text = failed_run(monkeypatch, tmp_path, tiny_data, "inf-grad@3", 2, 1, 1, 6, "--save-interval", "2")
    assert ("the gradient norm is NaN or Inf at iteration 3; stopped at iteration 3 without saving it. Last good "
            f"checkpoint: iter_0000002 in {save} (relaunch with --load {save} to resume from it)") in text
    assert read_latest(save) == "iter_0000002"
    assert not os.path.exists(os.path.join(save, "iter_0000003"))
    rows = metrics_records(save)
    assert math.isfinite(rows[3]["loss"]) and rows[3]["grad_norm"] == math.inf


@pytest.mark.slow
def test_without_per_iteration_checks_a_save_is_still_checked(monkeypatch, tmp_path, tiny_data):
    # Checked only where it logs or saves (4, 8): the NaN of iteration 6 is found at 8, before 8 is saved.
    save, text = failed_run(monkeypatch, tmp_path, tiny_data, "nan-loss@6", 2, 2, 1, 12,
                            "--no-check-for-nan-in-loss-and-grad", "--log-interval", "4", "--save-interval", "4")
    assert ("NaN or Inf at iteration 6; stopped at iteration 8 without saving it. Last good checkpoint: "
            f"iter_0000004 in {save}") in text
    assert read_latest(save) == "iter_0000004"
    assert not os.path.exists(os.path.join(save, "iter_0000008"))


@pytest.mark.slow
def test_no_save_dir_names_no_checkpoint(monkeypatch, tmp_path, tiny_data):
    argv = [a for a in tiny_pretrain_args(tiny_data, "unused", 3) if a not in ("--save", "unused", "--async-save")]
    argv += ["--metrics-file", str(tmp_path / "m.jsonl")]
    monkeypatch.setenv(INJECT, "nan-loss@2")
    with pytest.raises(RankFailure, match=r"at iteration 2; .* Last good checkpoint: none \(no --save\)"):
        run_distributed(run_pretrain, world_size=1, deadline_s=300, argv=argv)


def run_as_fp16(topology, argv):
    """fp16's rules (a non-finite gradient norm is an overflow to skip and count, not an error) on a CPU run,
    whose inf gradients DeepSpeed really skips."""
    real = trainer._numerical_health

    def fp16_health(run):
        health = real(run)
        health.check_grad_norm = False
        return health

    trainer._numerical_health = fp16_health
    pretrain.main(argv)


@pytest.mark.slow
def test_fp16_skips_are_counted_and_a_long_run_of_them_stops(monkeypatch, tmp_path, tiny_data):
    # Iteration 3 overflows alone; from 5 on every step does: 5, 6, 7, 8 make 4 in a row, more than 3.
    save, text = failed_run(monkeypatch, tmp_path, tiny_data, "inf-grad@3,5-", 1, 1, 1, 12, "--save-interval", "2",
                            "--max-consecutive-skipped-iterations", "3", fn=run_as_fp16)
    assert ("4 consecutive iterations were skipped by fp16 dynamic loss scaling (the gradients overflow at every loss "
            "scale), more than --max-consecutive-skipped-iterations 3; stopped at iteration 8 without saving it. "
            f"Last good checkpoint: iter_0000006 in {save}") in text
    rows = metrics_records(save)
    assert {i: r["skipped_iterations"] for i, r in rows.items()} == {1: 0, 2: 0, 3: 1, 4: 0, 5: 1, 6: 1, 7: 1, 8: 1}
    assert all(math.isfinite(r["loss"]) for r in rows.values())  # skipped, not broken: no NaN error
    assert rows[5]["grad_norm"] == math.inf
    assert read_latest(save) == "iter_0000006"
    assert not os.path.exists(os.path.join(save, "iter_0000008"))


# ---- the pieces, without ranks ----

def health(**kw):
    args = dict(every_iteration=True, check_grad_norm=True, max_consecutive_skipped=0, skipped_steps=0,
                device=torch.device("cpu"))
    return NumericalHealth(**{**args, **kw})


def verdict(h: NumericalHealth) -> str | None:
    return h.judge(h.local_flags().tolist())  # a world of one: the all-reduce is the identity


def test_health_names_the_first_bad_iteration():
    h = health()
    h.observe(1, torch.tensor(2.0), torch.tensor(1.0), 0)
    assert verdict(h) is None
    h.observe(2, torch.tensor(2.0), float("inf"), 1)  # DeepSpeed's overflow: a float inf
    h.observe(3, torch.tensor(float("nan")), torch.tensor(-1.0), 2)  # -1: DeepSpeed's invalid-norm sentinel
    assert verdict(h) == "the gradient norm is NaN or Inf at iteration 2"
    h = health(check_grad_norm=False)  # fp16: overflows are skipped, not errors; the loss still counts
    h.observe(1, torch.tensor(2.0), float("inf"), 1)
    assert verdict(h) is None
    h.observe(2, torch.tensor(float("inf")), None, 1)
    assert verdict(h) == "the loss is NaN or Inf at iteration 2"


def test_skip_counting_per_interval_and_in_a_row():
    h = health(check_grad_norm=False, max_consecutive_skipped=2, skipped_steps=7)  # 7 before a resume
    for iteration, total in enumerate([7, 8, 9, 9, 10, 11], start=1):
        h.observe(iteration, torch.tensor(1.0), None, total)
        if iteration == 3:
            assert h.take_skipped_in_interval() == 2 and h.consecutive_skipped == 2 and not h.too_many_skipped
    assert h.take_skipped_in_interval() == 2 and h.consecutive_skipped == 2 and verdict(h) is None
    h.observe(7, torch.tensor(1.0), None, 12)
    assert h.too_many_skipped and verdict(h).startswith("3 consecutive iterations were skipped")
    h = health(check_grad_norm=False, max_consecutive_skipped=0)  # 0: no limit
    for iteration in range(1, 100):
        h.observe(iteration, torch.tensor(1.0), None, iteration)
    assert verdict(h) is None and h.take_skipped_in_interval() == 99


def _two_ranks_disagree(topology):
    h = health(every_iteration=False)
    h.observe(9 if topology.rank == 0 else 4, torch.tensor(float("nan")), 1.0, 0)  # rank 1 saw it first
    exits = ExitConditions(signal_handler=False, duration_mins=None, start_time=0.0, device=torch.device("cpu"))
    assert exits.check(h, due=False) is None and h.problem is None  # not due: no collective at all
    assert exits.check(h, due=True) is None
    return h.problem


def test_ranks_agree_on_the_earliest_bad_iteration():
    assert run_distributed(_two_ranks_disagree, world_size=2) == ["the loss is NaN or Inf at iteration 4"] * 2


def test_deepspeed_giving_up_on_the_loss_scale_is_the_same_error(monkeypatch, tmp_path):
    def step(run, batches, memory=None):
        raise Exception("Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.")

    monkeypatch.setattr(trainer, "train_step", step)
    (tmp_path / "latest").write_text("iter_0000010")
    run = type("FakeRun", (), {"train": parse_args(["--data-path", "x", "--save", str(tmp_path)]).train,
                                "checkpoints": CheckpointManager(str(tmp_path)),
                                "topology": type("T", (), {"rank": 1})(), "step_context": None})()
    h = health(check_grad_norm=False)
    h.consecutive_skipped = 17
    with pytest.raises(NumericalHealthError) as error:
        trainer._checked_train_step(run, None, h, 12)
    assert error.value.code == 1
    assert str(error.value) == (
        "18 consecutive iterations were skipped by fp16 dynamic loss scaling and the loss scale is at its minimum "
        "(fp16.min_loss_scale): the gradients overflow at every loss scale; stopped at iteration 12 without saving "
        f"it. Last good checkpoint: iter_0000010 in {tmp_path} (relaunch with --load {tmp_path} to resume from it)")


def test_injection_spec():
    hook, applies = fault_injection.injection_from_spec("inf-grad@3,7-")
    assert hook is fault_injection.inf_grad_output and [i for i in range(1, 10) if applies(i)] == [3, 7, 8, 9]
    assert fault_injection.injection_from_spec(None) is None and fault_injection.injection_from_spec("") is None
    with pytest.raises(ValueError, match="expected nan-loss@, inf-grad@ or kill-job@ITERATIONS"):
        fault_injection.injection_from_spec("nan@3")


def test_flags():
    args = parse_args(["--data-path", "x"])
    assert args.train.check_for_nan_in_loss_and_grad and args.train.max_consecutive_skipped_iterations == 20
    args = parse_args(["--data-path", "x", "--no-check-for-nan-in-loss-and-grad",
                       "--max-consecutive-skipped-iterations", "-1"])
    assert not args.train.check_for_nan_in_loss_and_grad
    with pytest.raises(ConfigError, match="--max-consecutive-skipped-iterations -1 must be >= 0"):
        validate(args, 1)
