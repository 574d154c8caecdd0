"""What the loop feeds the model and the rate it reports: ``get_batch`` on hand-made tokens (labels shifted by one,
positions 0..s-1 that do not restart at an end-of-document token), and the logged ``lr`` of every iteration of a
real run equal to the schedule's ``lr_at(iteration)``, itself checked against hand-computed values."""

import pytest
import torch

from codegeex_train import pretrain
from codegeex_train.config.arguments import parse_args
from tests.harness import metrics_records, run_distributed, tiny_model_args
from codegeex_train.training import batches as data
from codegeex_train.training.optim import LRSchedule

pytestmark = pytest.mark.slow  # every test in this file is in the slow tier (tests/conftest.py)

EOD = 0  # the shipped tokenizer's end-of-document id


def test_get_batch_shifts_labels_and_counts_positions_from_zero():
    text = torch.tensor([[10, 11, EOD, 13, 14, 15],
                         [20, 21, 22, 23, EOD, 25]])  # (b, s + 1): one packed sample per row
    batch = data.get_batch({"text": text}, torch.device("cpu"))
    assert batch["input_ids"].tolist() == [[10, 11, EOD, 13, 14], [20, 21, 22, 23, EOD]]
    assert batch["labels"].tolist() == [[11, EOD, 13, 14, 15], [21, 22, 23, EOD, 25]]  # the next token of each
    # Positions count the packed sample, not the document: no restart after EOD (Megatron's default).
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4]] * 2
    assert batch["loss_mask"].dtype == torch.float32 and batch["loss_mask"].tolist() == [[1.0] * 5] * 2
    for key in ("input_ids", "labels"):
        assert batch[key].is_contiguous() and batch[key].dtype == text.dtype, key


LR, MIN_LR, WARMUP, DECAY_ITERS, ITERS = 1e-3, 1e-4, 2, 6, 8


def run_pretrain(topology, argv):
    pretrain.main(argv)


def test_logged_lr_is_the_schedule_at_every_iteration(tmp_path, tiny_data):
    argv = [*tiny_model_args(), "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
            "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", str(ITERS), "--lr", str(LR),
            "--min-lr", str(MIN_LR), "--lr-warmup-iters", str(WARMUP), "--lr-decay-iters", str(DECAY_ITERS),
            "--lr-decay-style", "linear", "--log-interval", "1", "--eval-interval", "1000", "--data-path", tiny_data,
            "--split", "100,0,0", "--save", str(tmp_path), "--no-progress-bar", "--num-workers", "0"]
    run_distributed(run_pretrain, world_size=1, deadline_s=300, argv=argv)
    logged = metrics_records(tmp_path)
    assert sorted(logged) == list(range(1, ITERS + 1))

    schedule = LRSchedule(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=LR), parse_args(argv).optim,
                          ITERS)
    for it, record in logged.items():
        assert record["lr"] == schedule.lr_at(it), it
    # ... and lr_at is the schedule asked for: linear warm-up to LR at 2, linear decay to MIN_LR at 6, then flat.
    hand = {1: LR / 2, 2: LR, 3: LR - (LR - MIN_LR) / 4, 4: (LR + MIN_LR) / 2, 6: MIN_LR, 7: MIN_LR, 8: MIN_LR}
    for it, lr in hand.items():
        assert logged[it]["lr"] == pytest.approx(lr, rel=1e-12), it
