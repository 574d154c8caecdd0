"""Pipeline parallelism end to end under DeepSpeed ZeRO-2, on real gloo ranks: losses and grad norms at
(TP, PP, DP) layouts equal the single-process run, the tied word embedding stays bit-identical on both ends
of the pipeline (and a last-stage copy that starts different is made equal to the first stage's, fp32 master
too, by the start-up sync), breaking the tied-gradient all-reduce is caught, and a PP = 2 resume is exact."""

import os
import shutil

import numpy as np
import pytest
import torch

from codegeex_train import pretrain
from codegeex_train.checkpoint import resume
from codegeex_train.checkpoint.files import write_latest
from codegeex_train.pipeline.shared_embedding import shared_embedding_weight
from tests.harness import load_tool, metrics_records, run_distributed, tiny_pretrain_args
from codegeex_train.training import trainer

ITERS = 10
LAYOUTS = [(1, 2, 1), (2, 2, 1), (1, 4, 1), (1, 2, 2), (2, 2, 2)]  # (TP, PP, DP)
CLIP = 0.5


def pipeline_args(data, save, tp, pp, dp, iters=ITERS, *extra):
    # 8 sequences per step = 4 micro-batches per DP rank at DP 1 (micro 2) and DP 2 (micro 1).
    return tiny_pretrain_args(data, save, iters, "--num-layers", "4", "--micro-batch-size", str(2 // dp),
                     "--clip-grad", str(CLIP), "--tensor-model-parallel-size", str(tp),
                     "--pipeline-model-parallel-size", str(pp), *extra)


def train_and_return_embedding(topology, argv, break_hook=False):
    """pretrain.main, then this rank's word-embedding table (first stage: input; last: output layer)."""
    captured = {}
    real_train = pretrain.train

    def train(run, *args, **kwargs):
        state = real_train(run, *args, **kwargs)
        weight = shared_embedding_weight(run.engine.module)
        captured["weight"] = None if weight is None else weight.detach().clone().numpy()
        return state

    pretrain.train = train
    if break_hook:  # the deliberately broken variant: the two copies' gradients are never summed
        trainer.allreduce_shared_embedding_grads = lambda module, topology: None
    pretrain.main(argv)
    assert (run_sizes := (topology.tp_size, topology.pp_size)) == (
        int(argv[argv.index("--tensor-model-parallel-size") + 1]),
        int(argv[argv.index("--pipeline-model-parallel-size") + 1])), run_sizes
    return {"coords": (topology.tp_rank, topology.pp_rank, topology.dp_rank), "weight": captured["weight"]}


def run_layout(tmp_path, data, tp, pp, dp, name=None, break_hook=False):
    save = str(tmp_path / (name or f"tp{tp}pp{pp}dp{dp}"))
    ranks = run_distributed(train_and_return_embedding, world_size=tp * pp * dp, tp_size=tp, pp_size=pp,
                            deadline_s=600, argv=pipeline_args(data, save, tp, pp, dp), break_hook=break_hook)
    return metrics_records(save), ranks


def full_table(ranks, tp, pp_rank, dp_rank=0):
    """The word table of one stage, TP shards concatenated by vocab rows."""
    shards = {r["coords"][0]: r["weight"] for r in ranks if r["coords"][1:] == (pp_rank, dp_rank)}
    return np.concatenate([shards[t] for t in range(tp)])


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, tiny_data):
    return run_layout(tmp_path_factory.mktemp("pp"), tiny_data, 1, 1, 1)


@pytest.mark.parametrize("tp,pp,dp", [LAYOUTS[0], *(pytest.param(*x, marks=pytest.mark.slow) for x in LAYOUTS[1:])])
def test_pipeline_matches_single_process(tmp_path, tiny_data, baseline, tp, pp, dp):
    base, base_ranks = baseline
    run, ranks = run_layout(tmp_path, tiny_data, tp, pp, dp)
    assert sorted(run) == list(range(1, ITERS + 1))
    assert base[ITERS]["loss"] < base[1]["loss"]  # it learns
    assert max(base[it]["grad_norm"] for it in base) > CLIP  # clipping is active
    for it in range(1, ITERS + 1):
        assert run[it]["loss"] == pytest.approx(base[it]["loss"], rel=1e-4), it
        assert run[it]["grad_norm"] == pytest.approx(base[it]["grad_norm"], rel=1e-4), it
    # Both ends of the pipeline hold bit-identical copies on every (TP, DP) rank ...
    for r in ranks:
        t, p, d = r["coords"]
        if p == pp - 1:
            first = next(q for q in ranks if q["coords"] == (t, 0, d))
            assert np.array_equal(r["weight"], first["weight"]), r["coords"]
        elif p > 0:
            assert r["weight"] is None  # middle stages hold no word embedding
    # ... equal to the single-process model's table after the same training.
    torch.testing.assert_close(full_table(ranks, tp, pp - 1), full_table(base_ranks, 1, 0), rtol=0, atol=1e-5)


def test_skipping_the_tied_gradient_allreduce_is_caught(tmp_path, tiny_data, baseline):
    base, _ = baseline
    run, ranks = run_layout(tmp_path, tiny_data, 1, 2, 1, name="broken", break_hook=True)
    worst = max(abs(run[it]["loss"] / base[it]["loss"] - 1) for it in base)
    assert worst > 1e-4, worst  # the parity test above would fail
    assert not np.array_equal(full_table(ranks, 1, 0), full_table(ranks, 1, 1))  # and the copies drift apart


def perturb_sync_and_train(topology, argv):
    """pretrain.main where, just before the start-up sync_shared_embedding, the last stage's copy of the word table
    (model weight and ZeRO's fp32 master) gets noise; this rank's table (and fp32 master) right after the sync
    and after training, as numpy, with the noisy copy before the sync."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_set_full_fp32_param

    captured = {}
    real_sync, real_train = resume.sync_shared_embedding, pretrain.train

    def numpy_weight_and_master(module):
        weight = shared_embedding_weight(module)
        master = safe_get_full_fp32_param(weight)  # a collective over DP, on every DP rank of this stage
        return weight.detach().clone().numpy(), None if master is None else master.detach().clone().numpy()

    @torch.no_grad()
    def sync(module, topo):
        weight = shared_embedding_weight(module)
        if topo.is_last_stage:  # the same noise on every DP rank (a replicated weight), another per TP shard
            noise = torch.randn(weight.shape, generator=torch.Generator().manual_seed(100 + topo.tp_rank))
            weight.add_(0.1 * noise)
            assert hasattr(weight, "_hp_mapping"), "not under a ZeRO optimizer: no fp32 master to perturb"
            safe_set_full_fp32_param(weight, weight.detach().float())
        captured["before"] = numpy_weight_and_master(module)[0]
        real_sync(module, topo)
        captured["synced"], captured["synced_master"] = numpy_weight_and_master(module)

    def train(run, *args, **kwargs):
        state = real_train(run, *args, **kwargs)
        captured["trained"] = shared_embedding_weight(run.engine.module).detach().clone().numpy()
        return state

    resume.sync_shared_embedding, pretrain.train = sync, train
    pretrain.main(argv)
    return {"coords": (topology.tp_rank, topology.pp_rank, topology.dp_rank), **captured}


@pytest.mark.slow
def test_sync_makes_a_different_last_stage_copy_equal(tmp_path, tiny_data):
    """TP 1 x PP 2 x DP 2 (ZeRO-2 partitions the fp32 master over DP): a last-stage copy perturbed before the
    start-up sync equals the first stage's, bit for bit, right after it (model weight and fp32 master), and after
    3 training steps."""
    ranks = run_distributed(perturb_sync_and_train, world_size=4, pp_size=2, deadline_s=600,
                            argv=pipeline_args(tiny_data, str(tmp_path / "run"), 1, 2, 2, 3))
    by_coords = {r["coords"]: r for r in ranks}
    for (t, p, d), last in by_coords.items():
        if p == 0:
            continue
        first = by_coords[(t, 0, d)]
        assert not np.array_equal(last["before"], first["before"]), "the perturbation did not happen"
        assert np.array_equal(last["synced"], first["synced"]), ("model weight after the sync", (t, p, d))
        assert np.array_equal(last["synced_master"], first["synced"]), ("fp32 master after the sync", (t, p, d))
        assert np.array_equal(first["synced_master"], first["synced"]), (t, p, d)
        assert np.array_equal(last["trained"], first["trained"]), ("after training", (t, p, d))
        assert not np.array_equal(first["trained"], first["synced"])  # it trained


@pytest.mark.slow
def test_resume_at_pp2_is_exact(tmp_path, tiny_data):
    # TP 1 x PP 2 x DP 2: each stage's ZeRO-2 partitions and both copies of the tied table come back.
    full = str(tmp_path / "full")
    run_distributed(train_and_return_embedding, world_size=4, pp_size=2, deadline_s=600,
                    argv=pipeline_args(tiny_data, full, 1, 2, 2, ITERS, "--save-interval", "5"))
    resumed = str(tmp_path / "resumed")
    shutil.copytree(full, resumed)
    os.remove(os.path.join(resumed, "metrics.jsonl"))
    write_latest(resumed, "iter_0000005")
    run_distributed(train_and_return_embedding, world_size=4, pp_size=2, deadline_s=600,
                    argv=pipeline_args(tiny_data, resumed, 1, 2, 2, ITERS, "--load", resumed, "--save-interval", "5"))
    a, b = metrics_records(full), metrics_records(resumed)
    assert sorted(b) == list(range(6, ITERS + 1))
    for it in range(6, ITERS + 1):
        for key in ("loss", "lr", "grad_norm"):
            assert b[it][key] == pytest.approx(a[it][key], rel=1e-6, abs=1e-9), (it, key)
        assert b[it]["consumed_samples"] == a[it]["consumed_samples"] == 8 * it


@pytest.mark.slow
def test_converted_checkpoint_trains_alike_at_another_layout(tmp_path, tiny_data, baseline):
    # Weights trained at PP 2, re-sharded by tools/convert_checkpoint.py to PP 2 and to TP 2 x PP 1: both
    # continue identically (weights only: the optimizer state starts afresh, as with a Hugging Face import).
    trained = str(tmp_path / "trained")
    run_distributed(train_and_return_embedding, world_size=2, pp_size=2, deadline_s=600,
                    argv=pipeline_args(tiny_data, trained, 1, 2, 1, 5))
    convert, runs = load_tool("convert_checkpoint"), {}
    for tp, pp in [(1, 2), (2, 1)]:
        weights = str(tmp_path / f"weights_tp{tp}pp{pp}")
        convert.main(["--load", trained, "--save", weights, "--tensor-model-parallel-size", str(tp),
                      "--pipeline-model-parallel-size", str(pp)])
        save = str(tmp_path / f"continued_tp{tp}pp{pp}")
        run_distributed(train_and_return_embedding, world_size=2, tp_size=tp, pp_size=pp, deadline_s=600,
                        argv=pipeline_args(tiny_data, save, tp, pp, 1, 5, "--load", weights))
        runs[(tp, pp)] = metrics_records(save)
    a, b = runs[(1, 2)], runs[(2, 1)]
    assert a[1]["loss"] < baseline[0][1]["loss"] - 0.1  # the trained weights were loaded
    for it in range(1, 6):
        assert b[it]["loss"] == pytest.approx(a[it]["loss"], rel=1e-4), it
        assert b[it]["grad_norm"] == pytest.approx(a[it]["grad_norm"], rel=1e-4), it
