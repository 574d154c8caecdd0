"""Sequence parallelism (--sequence-parallel) end to end under DeepSpeed ZeRO-2, on real gloo ranks: at every
(TP, PP, DP) layout the losses and grad norms of 5 iterations equal the single-process run, without recompute, with
selective recompute (every module) and with full recompute; skipping the TP all-reduce of the sequence-parallel
parameters' gradients, or doing it twice, breaks that parity; a checkpoint saved with SP resumes without it (at TP 2
directly, at TP 1 through the universal format); SP at TP 1 warns and changes nothing.

Ranks cost seconds to start and import, so each layout is one spawned group whose ranks call ``pretrain.main`` once
per recompute mode (separate --save directories), and the single-process baseline runs once (module fixture).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from codegeex_train import pretrain
from codegeex_train.checkpoint.files import load_model_checkpoint
from codegeex_train.config.arguments import parse_args
from codegeex_train.generation.generator import Generator
from codegeex_train.generation.sampling import SamplingParams
from codegeex_train.layout.plan import ParallelPlan
from codegeex_train.model import CodeGeeXModel, ModelGroups
from tests.harness import (
    checkpoint_at,
    load_tool,
    metrics_records,
    run_distributed,
    tiny_pretrain_args,
    worst_relative,
)

ITERS = 5  # past the 2 warm-up iterations; every one clips (grad norm > CLIP) and the loss falls
CLIP = 0.5
TOL = 1e-5  # relative, every iteration
LAYOUTS = [(2, 1, 1), (4, 1, 1), (2, 2, 1), (2, 1, 2), (2, 2, 2)]  # (TP, PP, DP)
SELECTIVE = ["--recompute-granularity", "selective", "--recompute-modules", "core_attn", "mlp_act", "layernorm"]
# Full recompute, spelled and split differently per layout (4 layers; 2 per stage at PP 2), and what the model says.
FULL = {
    (2, 1, 1): (["--checkpoint-activations"], "full (uniform, 1 layer)"),
    (4, 1, 1): (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "2"],
                "full (uniform, 2 layers)"),
    (2, 2, 1): (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1"],
                "full (block, 1 layer)"),
    (2, 1, 2): (["--recompute-granularity", "full"], "full (uniform, 1 layer)"),
    (2, 2, 2): (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "2"],
                "full (block, 2 layers)"),
}
MODES = ("none", "selective", "full")


def sp_args(data, save, tp, pp, dp, iters=ITERS, *extra):
    # 4 layers, 4 sequences per step in 2 micro-batches (of 2 at DP 1, of 1 per DP rank at DP 2: at PP 2 a 1F1B
    # warm-up, steady and cool-down step), clipping.
    return tiny_pretrain_args(data, str(save), iters, "--num-layers", "4", "--micro-batch-size", str(2 // dp),
                              "--global-batch-size", "4", "--clip-grad", str(CLIP),
                              "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
                              *extra)


def train_runs(topology, runs):
    """``pretrain.main`` once per (argv, seam) of ``runs`` on these ranks. ``seam``: None, or the deliberately broken
    TP all-reduce of the sequence-parallel gradients, "skip" (never) or "twice". Returns what each run's model
    was built with (sequence parallel, recompute) and any warnings."""
    from codegeex_train.tensor_parallel import layers

    real_allreduce, real_train = layers.allreduce_sequence_parallel_grad, pretrain.train
    seams = {None: real_allreduce, "skip": lambda grad, group: grad,
             "twice": lambda grad, group: real_allreduce(real_allreduce(grad, group), group)}
    seen = []

    def train(run, *args, **kwargs):
        model = run.engine.module
        seen.append({"sequence_parallel": model.sequence_parallel, "recompute": model.recompute.describe(),
                     "p2p_shape": tuple(run.p2p.shape)})
        return real_train(run, *args, **kwargs)

    pretrain.train = train
    try:
        for argv, seam in runs:
            layers.allreduce_sequence_parallel_grad = seams[seam]
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                pretrain.main(argv)
            seen[-1]["warnings"] = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    finally:
        layers.allreduce_sequence_parallel_grad, pretrain.train = real_allreduce, real_train
    return seen


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, tiny_data):
    """(1,1,1) without SP, and (1,1,1) with --sequence-parallel (a no-op at TP 1), in one spawn."""
    root = tmp_path_factory.mktemp("sp_base")
    runs = [(sp_args(tiny_data, root / name, 1, 1, 1, ITERS, *extra), None)
            for name, extra in (("base", []), ("sp_tp1", ["--sequence-parallel"]))]
    seen = run_distributed(train_runs, world_size=1, deadline_s=600, runs=runs)[0]
    return {"base": metrics_records(root / "base"), "sp_tp1": metrics_records(root / "sp_tp1"), "seen": seen}


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory, tiny_data):
    """(TP, PP, DP) -> ({mode: metrics}, what each rank's models were built with), one spawn per layout."""
    _layouts = {}

    def get(tp, pp, dp):
        if (tp, pp, dp) not in _layouts:
            root = tmp_path_factory.mktemp(f"sp_tp{tp}pp{pp}dp{dp}")
            extra = {"none": [], "selective": SELECTIVE, "full": FULL[(tp, pp, dp)][0]}
            runs = [(sp_args(tiny_data, root / mode, tp, pp, dp, ITERS, "--sequence-parallel", *extra[mode]), None)
                    for mode in MODES]
            seen = run_distributed(train_runs, world_size=tp * pp * dp, tp_size=tp, pp_size=pp, deadline_s=600,
                                   runs=runs)
            _layouts[(tp, pp, dp)] = {mode: metrics_records(root / mode) for mode in MODES}, seen
        return _layouts[(tp, pp, dp)]

    return get


def test_baseline_clips_learns_and_has_the_top_query_layer(baseline, tiny_data):
    base = baseline["base"]
    assert sorted(base) == list(range(1, ITERS + 1))
    assert base[ITERS]["loss"] < base[1]["loss"]  # it learns
    assert max(base[it]["grad_norm"] for it in base) > CLIP  # clipping is active
    assert parse_args(sp_args(tiny_data, "x", 1, 1, 1)).model.top_query_layer  # the layer with its own SP gathers


def test_sequence_parallel_at_tp1_warns_and_changes_nothing(baseline):
    base, sp = baseline["base"], baseline["sp_tp1"]
    plain_run, sp_run = baseline["seen"]
    assert plain_run["warnings"] == [] and not sp_run["sequence_parallel"]
    assert any("--sequence-parallel with --tensor-model-parallel-size 1 does nothing" in w for w in sp_run["warnings"])
    assert sorted(sp) == sorted(base)
    for it in base:
        assert (sp[it]["loss"], sp[it]["grad_norm"]) == (base[it]["loss"], base[it]["grad_norm"]), it


@pytest.mark.parametrize("tp,pp,dp", [LAYOUTS[0], *(pytest.param(*x, marks=pytest.mark.slow) for x in LAYOUTS[1:])])
def test_sequence_parallel_matches_single_process(baseline, layout_runs, tp, pp, dp):
    base = baseline["base"]
    runs, ranks = layout_runs(tp, pp, dp)
    for seen in ranks:  # every rank's model really was sequence parallel, under the mode asked for
        assert [s["sequence_parallel"] for s in seen] == [True] * 3
        assert [s["recompute"] for s in seen] == ["none", "selective (core_attn, mlp_act, layernorm)",
                                                  FULL[(tp, pp, dp)][1]]
        assert {s["p2p_shape"] for s in seen} == {(2 // dp, 32 // tp, 32)}  # (b, s/tp, h) between stages
    worst_seen = {}
    for mode in MODES:
        run = runs[mode]
        assert sorted(run) == list(range(1, ITERS + 1)), mode
        for it in range(1, ITERS + 1):
            for key in ("loss", "grad_norm"):
                assert run[it][key] == pytest.approx(base[it][key], rel=TOL), (mode, it, key)
        worst_seen[mode] = (worst_relative(run, base, "loss"), worst_relative(run, base, "grad_norm"))
    print(f"(TP, PP, DP) = {(tp, pp, dp)}: worst relative (loss, grad norm) vs (1,1,1):", worst_seen)


@pytest.mark.slow
def test_broken_sequence_parallel_grad_allreduce_is_caught(tmp_path, tiny_data, baseline):
    """TP 2 with the sequence-parallel parameters' gradients never all-reduced over TP, then all-reduced twice: the
    parity above fails for each (both the losses and the grad norms leave the 1e-5 band)."""
    base = baseline["base"]
    runs = [(sp_args(tiny_data, tmp_path / seam, 2, 1, 1, ITERS, "--sequence-parallel"), seam)
            for seam in ("skip", "twice")]
    run_distributed(train_runs, world_size=2, tp_size=2, deadline_s=600, runs=runs)
    for seam in ("skip", "twice"):
        run = metrics_records(tmp_path / seam)
        assert sorted(run) == list(range(1, ITERS + 1))
        loss, grad_norm = worst_relative(run, base, "loss"), worst_relative(run, base, "grad_norm")
        print(f"{seam}: worst relative loss {loss:.3g}, grad norm {grad_norm:.3g}")
        assert loss > TOL and grad_norm > TOL, (seam, loss, grad_norm)


SAVED_AT, RESUME_ITERS = 3, 5


def save_with_sp_resume_without(topology, full_argv, resumed_argv, full, at_save, universal):
    """TP 2: train with SP (saving at SAVED_AT); rank 0 cuts the checkpoint at SAVED_AT and converts it to universal;
    then resume that checkpoint at TP 2 without SP."""
    pretrain.main(full_argv)
    # Generation ignores SP but loads its checkpoints: the same logits as the model built with SP, then decoding.
    generator = Generator.from_checkpoint(full, None, tp_group=topology.tp_group)
    with_sp = CodeGeeXModel(generator.config, ModelGroups.from_topology(topology),
                            ParallelPlan.derive(topology.dims, micro_batch_size=1, sequence_parallel=True)).eval()
    load_model_checkpoint(full, with_sp)
    ids = torch.arange(3, 3 + 16).reshape(2, 8)
    positions = torch.arange(8).expand(2, 8)
    with torch.no_grad():
        gap = (with_sp(ids, positions, gather_logits=True) - generator.model(ids, positions, gather_logits=True))
    decoded = generator.generate_ids([[3, 4, 5]], SamplingParams(max_new_tokens=4))
    if topology.rank == 0:
        checkpoint_at(full, at_save, SAVED_AT)
        load_tool("convert_checkpoint").main(["--load", at_save, "--to-universal", universal])
    dist.barrier()
    pretrain.main(resumed_argv)
    return {"logits_gap": gap.abs().max().item(), "decoded": decoded}


@pytest.mark.slow
def test_checkpoint_saved_with_sp_resumes_without(tmp_path, tiny_data):
    """Saved at TP 2 + SP: resumed at TP 2 without SP (the checkpoint as it is: SP changes no parameter layout) and
    at (1,1,1) through the universal format, each iteration as the uninterrupted SP run logged it."""
    full, at_save, universal = tmp_path / "full", tmp_path / "at_save", tmp_path / "universal"
    args = lambda save, tp, *extra: tiny_pretrain_args(tiny_data, str(save), RESUME_ITERS, "--save-interval",
                                                       str(SAVED_AT), "--tensor-model-parallel-size", str(tp), *extra)
    ranks = run_distributed(save_with_sp_resume_without, world_size=2, tp_size=2, deadline_s=600,
                            full_argv=args(full, 2, "--sequence-parallel"),
                            resumed_argv=args(tmp_path / "tp2", 2, "--load", str(at_save)),
                            full=str(full), at_save=str(at_save), universal=str(universal))
    for rank in ranks:  # the SP checkpoint, loaded for generation (no SP): same logits, and it decodes
        assert rank["logits_gap"] < 1e-5 and len(rank["decoded"][0]) == 4, rank
    assert ranks[0]["decoded"] == ranks[1]["decoded"]
    run_distributed(train_runs, world_size=1, deadline_s=600,
                    runs=[(args(tmp_path / "tp1", 1, "--load", str(universal)), None)])
    reference = metrics_records(full)
    for name in ("tp2", "tp1"):
        resumed = metrics_records(tmp_path / name)
        assert sorted(resumed) == list(range(SAVED_AT + 1, RESUME_ITERS + 1)), name
        for it in resumed:
            assert resumed[it]["consumed_samples"] == reference[it]["consumed_samples"], (name, it)
            for key in ("loss", "grad_norm"):
                assert resumed[it][key] == pytest.approx(reference[it][key], rel=TOL), (name, it, key)
        print(f"resumed {name}: worst relative loss {worst_relative(resumed, reference, 'loss'):.3g}, "
              f"grad norm {worst_relative(resumed, reference, 'grad_norm'):.3g}")
