"""The figures a real run logs, end to end: TFLOP/s and MFU against Megatron's FLOPs formula written out here, and,
from the same run (one run serves them all: CI time), its TensorBoard event files against metrics.jsonl and its
profiler trace of iterations 3-4.

The run: DP 2 (world size 2), micro-batch 1, global batch 4 (two micro-batches per rank), so the formula's batch, the
global one, differs from the micro-batch (x4) and from a rank's share (x2), and the world size divides. A second,
smaller run recomputes every layer (--recompute-granularity full): Megatron counts that forward once more."""

import json
import math
from pathlib import Path

import pytest

from codegeex_train.config.arguments import parse_args
from codegeex_train.tokenization.tokenizer import load_tokenizer
from tests.harness import metrics_records, read_metrics, run_distributed, run_pretrain, tiny_pretrain_args

LAYERS, HIDDEN, SEQ = 2, 32, 32  # tiny_model_args(); FFN 4h (the default), CodeGeeX's top query layer on
PEAK_TFLOPS = 0.05


def megatron_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int, full_recompute: bool) -> float:
    """Model FLOPs of one iteration (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
    Clusters", eq. 3): a layer's forward is 24 B s h^2 (1 + s/6h) (FFN 4h), backward twice that, full recompute one
    forward more; the logits 2 B s h V forward, twice that backward, never recomputed. With recompute this is the
    paper's 96 B s l h^2 (1 + s/6h + V/16lh). ``layers`` counts CodeGeeX's top query layer (the same matmuls)."""
    b, s, l, h, v = batch, seq, layers, hidden, vocab
    per_layer_forward = 24 * b * s * h * h * (1 + s / (6 * h))
    return (4 if full_recompute else 3) * l * per_layer_forward + 6 * b * s * h * v


def padded_vocab() -> int:
    vocab = load_tokenizer(parse_args(["--data-path", "x"]).data).vocab_size  # the shipped tokenizer the run uses
    return math.ceil(vocab / 128) * 128  # --make-vocab-size-divisible-by 128


def check_logged_speed(save: str, *, global_batch: int, world_size: int, full_recompute: bool) -> int:
    flops = megatron_flops(global_batch, SEQ, LAYERS + 1, HIDDEN, padded_vocab(), full_recompute)
    records = metrics_records(save)
    for it, r in records.items():
        seconds = r["iteration_time_ms"] / 1000
        assert r["tflops_per_device"] == pytest.approx(flops / seconds / world_size / 1e12, rel=1e-9), it
        assert r["mfu"] == pytest.approx(r["tflops_per_device"] / PEAK_TFLOPS, rel=1e-9), it
        assert r["tokens_per_s"] == pytest.approx(global_batch * SEQ / seconds, rel=1e-9), it
    return len(records)


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory, tiny_data) -> Path:
    """4 iterations at DP 2: TensorBoard, a profile of iterations 3-4, validation at 2 and 4, the test split at 4."""
    save = tmp_path_factory.mktemp("mfu") / "run"
    extra = ["--micro-batch-size", "1", "--global-batch-size", "4", "--eval-interval", "2", "--peak-tflops",
             str(PEAK_TFLOPS), "--tensorboard-dir", str(save / "tb"), "--profile", "--profile-step-start", "2",
             "--profile-step-end", "4"]
    run_distributed(run_pretrain, world_size=2, deadline_s=300,
                    argv=tiny_pretrain_args(tiny_data, str(save), 4, *extra))
    return save


def test_logged_tflops_and_mfu_are_megatrons_formula_at_the_global_batch(logged_run):
    assert check_logged_speed(str(logged_run), global_batch=4, world_size=2, full_recompute=False) == 4


def test_full_recompute_counts_the_forward_again(tmp_path, tiny_data):
    save = str(tmp_path / "recompute")
    extra = ["--micro-batch-size", "1", "--global-batch-size", "2", "--recompute-granularity", "full",
             "--peak-tflops", str(PEAK_TFLOPS)]
    run_distributed(run_pretrain, world_size=1, deadline_s=300, argv=tiny_pretrain_args(tiny_data, save, 2, *extra))
    assert check_logged_speed(save, global_batch=2, world_size=1, full_recompute=True) == 2
    b, s, l, h, v = 2, SEQ, LAYERS + 1, HIDDEN, padded_vocab()  # the paper's closed form, as printed
    assert megatron_flops(b, s, l, h, v, True) == pytest.approx(
        96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h)), rel=1e-12)


def test_tensorboard_holds_every_scalar_of_metrics_jsonl(logged_run):
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    expected = {}  # (tag, step) -> values, named as wandb names them: {split}/{key without the split's prefix}
    for record in read_metrics(logged_run):
        split = record["split"]
        if split == "metadata":
            continue
        for key, value in record.items():
            if key not in ("iteration", "split") and isinstance(value, (int, float)) and not isinstance(value, bool):
                expected.setdefault((f"{split}/{key.removeprefix(split + '_')}", record["iteration"]), []).append(
                    float(value))
    assert {tag.split("/")[0] for tag, _ in expected} >= {"train", "valid", "test", "memory"}

    event_files = list((logged_run / "tb").glob("events.out.tfevents.*"))
    assert len(event_files) == 1  # the logging rank only
    reader = EventAccumulator(str(logged_run / "tb"), size_guidance={"tensors": 0})
    reader.Reload()
    logged = {}
    for tag in reader.Tags()["tensors"]:
        for event in reader.Tensors(tag):
            logged.setdefault((tag, event.step), []).append(tensor_util.make_ndarray(event.tensor_proto).item())
    assert logged == expected  # the same names, steps and values, exactly (double precision)
    assert {step for tag, step in logged if tag == "train/loss"} == {1, 2, 3, 4}


def test_profiler_trace_holds_iterations_3_and_4_forward_and_backward(logged_run):
    traces = list((logged_run / "tb" / "profile").glob("*.pt.trace.json"))
    assert [t.name.split(".")[0] for t in traces] == ["rank0"]  # --profile-ranks 0 (the default)
    events = json.loads(traces[0].read_text())["traceEvents"]
    steps = {e["name"]: e for e in events if e.get("name", "").startswith("ProfilerStep#")}
    assert sorted(steps) == ["ProfilerStep#3", "ProfilerStep#4"]  # after iteration 2, up to iteration 4
    for name, span in steps.items():
        inside = [e["name"] for e in events if e.get("ph") == "X" and span["ts"] <= e["ts"] <= span["ts"] + span["dur"]]
        assert "aten::embedding" in inside, name  # the forward (the word embeddings' lookup)
        assert any(n.startswith("autograd::engine::evaluate_function: ") for n in inside), name  # the backward
