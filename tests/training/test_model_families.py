"""The architecture options of today's code-model families, end to end through the CLI under DeepSpeed ZeRO-2 on real
gloo ranks: for a Llama-shaped model (RMSNorm, SwiGLU, no biases, grouped-query attention, Llama 3's RoPE scaling,
tied), a Qwen2-shaped one (QKV biases only, 2 key-value groups, untied output layer) and a StarCoder2-shaped one
(LayerNorm and every bias, GeLU-tanh, grouped-query attention, a sliding window shorter than the sequence), 10
iterations at (TP, CP, PP, DP) layouts with SP, CP 2, interleaved PP 2 and DP 2 give the losses and grad norms of the
single-process run within 1e-5 relative, at every iteration.

Each world size is one spawn whose ranks call ``pretrain.main`` once per (family, layout).
"""

from __future__ import annotations

import pytest

from tests.harness import metrics_records, run_distributed, tiny_pretrain_args, worst_relative

ITERS = 10
CLIP = 0.5
TOL = 1e-5  # relative, every iteration
ROPE = ("--position-embedding-type", "rope")
FAMILIES = {
    "llama": (*ROPE, "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--swiglu", "--ffn-hidden-size", "64",
              "--disable-bias-linear", "--group-query-attention", "--num-query-groups", "2", "--rope-scaling", "llama3",
              "--rope-scaling-factor", "8", "--rope-original-max-position-embeddings", "16", "--rotary-base", "500000",
              "--no-top-query-layer"),
    "qwen2": (*ROPE, "--normalization", "RMSNorm", "--swiglu", "--ffn-hidden-size", "64", "--disable-bias-linear",
              "--add-qkv-bias", "--group-query-attention", "--num-query-groups", "2", "--rotary-base", "1000000",
              "--untie-embeddings-and-output-weights", "--no-top-query-layer"),
    "starcoder2": (*ROPE, "--activation", "gelu_tanh", "--group-query-attention", "--num-query-groups", "2",
                   "--window-size", "8", "--no-top-query-layer"),
}
INTERLEAVED = ("--num-layers-per-virtual-pipeline-stage", "1")
# (TP, CP, PP, DP), SP, extra flags
LAYOUTS = [((2, 1, 1, 1), True, ()), ((1, 2, 1, 1), False, ()), ((1, 1, 2, 1), False, INTERLEAVED),
           ((1, 1, 1, 2), False, ()), ((2, 1, 2, 1), False, ())]
FAST = ("qwen2", (2, 1, 2, 1))  # the fast tier's case: untied output layer across stages, TP with GQA


def family_args(data, save, family, tp=1, cp=1, pp=1, dp=1, sp=False, extra=()):
    # 4 layers (interleaving needs one per chunk), 4 heads in 2 key-value groups, 8 sequences of 32 tokens per step
    return tiny_pretrain_args(data, str(save), ITERS, "--num-layers", "4", "--micro-batch-size", str(2 // dp),
                              "--clip-grad", str(CLIP), "--tensor-model-parallel-size", str(tp),
                              "--context-parallel-size", str(cp), "--pipeline-model-parallel-size", str(pp),
                              *FAMILIES[family], *(["--sequence-parallel"] if sp else []), *extra)


def train_runs(topology, runs):
    from codegeex_train import pretrain

    for argv in runs:
        pretrain.main(argv)


def _name(family, layout, sp, extra):
    return f"{family}_{'_'.join(map(str, layout or (1, 1, 1, 1)))}{'_sp' if sp else ''}{'_vpp' if extra else ''}"


@pytest.fixture(scope="module")
def family_runs(request, tmp_path_factory, tiny_data):
    """(family, layout) -> metrics records, (family, None) -> the single-process baseline; one spawn per world. The
    fast tier (-m "not slow") trains its one case and that family's baseline only."""
    root = tmp_path_factory.mktemp("families")
    fast_only = request.config.getoption("markexpr", "") == "not slow"
    families = [FAST[0]] if fast_only else list(FAMILIES)
    keys = [(family, None, False, ()) for family in families]
    keys += [(family, *layout) for family in families for layout in LAYOUTS if not fast_only or layout[0] == FAST[1]]
    by_world: dict[int, list] = {}
    for key in keys:
        tp, cp, pp, dp = key[1] or (1, 1, 1, 1)
        by_world.setdefault(tp * cp * pp * dp, []).append(key)
    for world, group in by_world.items():
        runs = [family_args(tiny_data, root / _name(*key), key[0], *(key[1] or (1, 1, 1, 1)), sp=key[2], extra=key[3])
                for key in group]
        run_distributed(train_runs, world_size=world, deadline_s=1200, runs=runs)
    return {(key[0], key[1]): metrics_records(root / _name(*key)) for key in keys}


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_baseline_learns_and_clips(family_runs, family):
    base = family_runs[(family, None)]
    assert sorted(base) == list(range(1, ITERS + 1))
    assert base[ITERS]["loss"] < base[1]["loss"]
    assert max(r["grad_norm"] for r in base.values()) > CLIP


@pytest.mark.slow
def test_families_differ(family_runs):
    """Each family's flags reached the model: three different first losses."""
    assert len({family_runs[(family, None)][1]["loss"] for family in FAMILIES}) == len(FAMILIES)


@pytest.mark.parametrize("family,layout,sp,extra", [
    pytest.param(family, *layout, marks=() if (family, layout[0]) == FAST else pytest.mark.slow,
                 id=f"{family}-{'x'.join(map(str, layout[0]))}{'-sp' if layout[1] else ''}{'-vpp' if layout[2] else ''}")
    for family in FAMILIES for layout in LAYOUTS])
def test_family_layout_matches_single_process(family_runs, family, layout, sp, extra):
    base, run = family_runs[(family, None)], family_runs[(family, layout)]
    assert sorted(run) == list(range(1, ITERS + 1))
    for it in range(1, ITERS + 1):
        for key in ("loss", "grad_norm"):
            assert run[it][key] == pytest.approx(base[it][key], rel=TOL), (it, key)
    print(f"{family} {layout} sp={sp}: worst relative loss {worst_relative(run, base, 'loss'):.2g}, "
          f"grad norm {worst_relative(run, base, 'grad_norm'):.2g}")
