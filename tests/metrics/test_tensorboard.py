"""The TensorBoard sink on its own, read back with tensorboard's reader: wandb's names, exact values, Megatron's
switches and interval, a resumed run's purge. (A real run's event files against its metrics.jsonl:
tests/training/test_mfu.py.) No process group."""

import pytest

from codegeex_train.config.arguments import parse_args
from codegeex_train.metrics import MetricsLogger
from codegeex_train.metrics.logger import tensorboard_exclusions
from codegeex_train.metrics.tensorboard_sink import TensorBoardSink
from tests.harness import fails_with, tiny_model_args


def read_back(log_dir) -> dict[str, dict[int, float]]:
    """tag -> step -> value, the last event of a step winning, what TensorBoard shows."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    reader = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    reader.Reload()
    return {tag: {e.step: tensor_util.make_ndarray(e.tensor_proto).item() for e in reader.Tensors(tag)}
            for tag in reader.Tags()["tensors"]}


def test_numbers_go_in_under_wandbs_names_exactly(tmp_path):
    sink = TensorBoardSink(tmp_path)
    sink.write({"iteration": 3, "split": "train", "loss": 1.2345678901234567, "consumed_samples": 24,
                "comm_dp_bytes": 2**40 + 1, "recompute": "full", "sequence_parallel": True, "grad_norm": None})
    sink.write({"iteration": 4, "split": "valid", "valid_loss": 2.5, "valid_ppl": 12.182493960703473})
    sink.close()
    # float32, TensorBoard's default, would give 1.2345679 and 2**40
    assert read_back(tmp_path) == {"train/loss": {3: 1.2345678901234567}, "train/consumed_samples": {3: 24.0},
                                   "train/comm_dp_bytes": {3: 2.0**40 + 1}, "valid/loss": {4: 2.5},
                                   "valid/ppl": {4: 12.182493960703473}}


def test_megatrons_switches_and_interval(tmp_path):
    args = parse_args(["--data-path", "x", "--tensorboard-dir", str(tmp_path), "--tensorboard-log-interval", "2",
                       "--no-log-learnig-rate-to-tensorboard", "--no-log-loss-scale-to-tensorboard"])
    assert tensorboard_exclusions(args.logging) == {"lr", "loss_scale"}
    assert not parse_args(["--data-path", "x", "--no-log-learning-rate-to-tensorboard"]).logging \
        .log_learning_rate_to_tensorboard  # our spelling and Megatron's set the same switch
    with MetricsLogger(args.logging, enabled=True, save_dir=None, run_config={}, train_iters=4) as logger:
        for it in range(1, 5):
            logger.log({"iteration": it, "loss": float(it), "lr": 0.1, "loss_scale": 1.0, "grad_norm": 0.5})
        logger.log({"iteration": 3, "split": "valid", "valid_loss": 3.5})  # other splits: whatever the interval
    assert read_back(tmp_path) == {"train/loss": {2: 2.0, 4: 4.0}, "train/grad_norm": {2: 0.5, 4: 0.5},
                                   "valid/loss": {3: 3.5}}


def test_a_resumed_run_replaces_what_came_after_its_checkpoint(tmp_path):
    first = TensorBoardSink(tmp_path)
    for it in range(1, 5):  # a run that reached iteration 4, its last checkpoint at 2
        first.write({"iteration": it, "loss": float(it)})
    first.close()
    resumed = TensorBoardSink(tmp_path, start_iteration=2)
    resumed.write({"iteration": 3, "loss": 30.0})
    resumed.close()
    assert read_back(tmp_path) == {"train/loss": {1: 1.0, 2: 2.0, 3: 30.0}}  # 4 purged




@pytest.mark.parametrize("url, shown", [
    ("s3://bucket/tb", "s3://bucket/tb"), ("gs://bucket/tb", "gs://bucket/tb"), ("foo://tb", "foo://tb"),
    ("runs/https://host/tb", "runs/https://host/tb"),
    ("s3://AKIAIOSFODNN7EXAMPLE:wJalrXUtnFEMI@b/tb", "s3://<redacted>@b/tb")])
def test_a_url_is_one_error_line(tmp_path, monkeypatch, capsys, url, shown):
    """SummaryWriter hands a URL to fsspec, which fails on the logging rank after the process group exists ("Install
    s3fs to access S3", "Protocol not known: foo"): refused before anything starts, a credential in it redacted."""
    monkeypatch.chdir(tmp_path)
    err = fails_with(capsys, [*tiny_model_args(), "--data-path", "x", "--tensorboard-dir", url],
                     f"--tensorboard-dir {shown} is a URL", "give one")
    assert "wJalr" not in err and not list(tmp_path.iterdir())
