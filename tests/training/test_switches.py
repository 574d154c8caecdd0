"""Switches that could silently do nothing: --checkpoint-activations must really recompute, and evaluation must
really run, from the start of its split every time, and report the mean loss over exactly those batches."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from codegeex_train import pretrain
from codegeex_train.model.mlp import ParallelMLP
from tests.harness import metrics_records, run_distributed, tiny_model_args

pytestmark = pytest.mark.slow  # every test in this file is in the slow tier (tests/conftest.py)

MICRO, GLOBAL, ITERS = 2, 8, 2  # 4 micro-batches per step on one rank


def run_args(data, save, *extra):
    return [*tiny_model_args(), "--micro-batch-size", str(MICRO), "--global-batch-size", str(GLOBAL),
            "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "2e-3", "--lr-warmup-iters", "1",
            "--train-iters", str(ITERS), "--log-interval", "1", "--eval-iters", "2", "--data-path", data,
            "--split", "80,20,0", "--seed", "3", "--save", save, "--no-progress-bar", "--num-workers", "0",
            "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1", *extra]


def count_mlp_forwards(topology, argv):
    """Every layer (and the top query layer) runs one MLP: its forwards count the layer forwards."""
    calls = itertools.count()
    original = ParallelMLP.forward

    def counted(self, x):
        next(calls)
        return original(self, x)

    ParallelMLP.forward = counted
    try:
        pretrain.main(argv)
    finally:
        ParallelMLP.forward = original
    return next(calls)


def test_checkpoint_activations_recomputes_every_layer(tmp_path, tiny_data):
    layers = 2 + 1  # --num-layers 2 and the top query layer
    forwards = {}
    for name, extra in (("plain", ()), ("recompute", ("--checkpoint-activations",))):
        argv = run_args(tiny_data, str(tmp_path / name), "--eval-interval", "1000", *extra)
        forwards[name] = run_distributed(count_mlp_forwards, world_size=1, argv=argv)[0]
    per_pass = layers * (GLOBAL // MICRO) * ITERS
    assert forwards["plain"] == per_pass
    assert forwards["recompute"] == 2 * per_pass  # each layer's forward again inside its backward


def eval_by_hand(topology, argv):
    """Train (evaluating at iterations 1 and 2), then recompute the last evaluation from the final weights."""
    from codegeex_train.checkpoint.files import load_model_checkpoint
    from codegeex_train.model.codegeex import CodeGeeXModel
    from codegeex_train.training.batches import build_datasets, loader, num_samples

    pretrain.main(argv)
    prepared = pretrain.prepare(argv)
    args, layout = prepared.args, prepared.plan
    model = CodeGeeXModel(prepared.model, None, None, seed=0).eval()
    load_model_checkpoint(args.train.save, model)
    _, valid, _ = build_datasets(args.data, args.train, layout, 0)
    batches = loader(valid, 0, layout, 0, 0, num_samples(args.train, layout)[1])
    losses = []
    with torch.no_grad():
        for batch in itertools.islice(batches, args.train.eval_iters * layout.num_microbatches):
            text = batch["text"]  # (b, s + 1): inputs and next-token labels, written out here
            inputs, labels = text[:, :-1], text[:, 1:]
            positions = torch.arange(inputs.shape[1]).expand_as(inputs)
            logits = model(inputs, positions)  # TP 1: the full vocabulary
            losses.append(F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum").item()
                          / labels.numel())
    return sum(losses) / len(losses), len(losses)


def test_evaluation_runs_from_the_split_start_and_averages_its_batches(tmp_path, tiny_data):
    save = str(tmp_path / "eval")
    by_hand, batches = run_distributed(eval_by_hand, world_size=1,
                                       argv=run_args(tiny_data, save, "--eval-interval", "1"))[0]
    valid = metrics_records(save, "valid")
    assert sorted(valid) == [1, 2]  # it ran, at every --eval-interval
    assert batches == 2 * GLOBAL // MICRO
    # Evaluated at iteration 2 with the final weights: equal only if it read the split's first batches again.
    assert valid[2]["valid_loss"] == pytest.approx(by_hand, rel=1e-5)
    assert valid[1]["valid_loss"] != pytest.approx(by_hand, rel=1e-5)  # the weights did change in between


def train_quietly(topology, argv):
    pretrain.main(argv)


def test_training_builds_no_deepspeed_op(tmp_path, tiny_data, monkeypatch):
    # DeepSpeed's CPU backend would JIT-compile its inference-only all-reduce (40-75 s on a fresh clone).
    extensions = tmp_path / "torch_extensions"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(extensions))  # the spawned rank inherits it
    save = str(tmp_path / "quick")
    run_distributed(train_quietly, world_size=1, argv=run_args(tiny_data, save, "--eval-interval", "1000"))
    assert sorted(metrics_records(save)) == [1, 2]  # it trained
    assert not extensions.exists() or not any(extensions.iterdir())
