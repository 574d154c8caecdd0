"""Context parallelism (--context-parallel-size) end to end under DeepSpeed ZeRO-2, on real gloo ranks: at every
(TP, CP, PP, DP) layout the losses and grad norms of 5 iterations equal the single-process run's within 1e-5
relative, with rotary positions and with learned ones, the top query layer on and clipping active; each of three
broken CPs fails that parity (no load balancing, no log-sum-exp rescaling in the merge, CP left out of DeepSpeed's
gradient reduction).

Ranks cost seconds to start and import, so each world size is one spawned group whose ranks call ``pretrain.main``
once per layout (separate --save directories), and the single-process baselines run in one spawn (module fixture).
"""

from __future__ import annotations

import pytest
import torch

from codegeex_train import pretrain
from tests.harness import (
    checkpoint_at,
    load_tool,
    metrics_records,
    run_distributed,
    run_pretrain,
    tiny_pretrain_args,
    worst_relative,
)

ITERS = 5  # past the 2 warm-up iterations; every one clips (grad norm > CLIP) and the loss falls
CLIP = 0.5
TOL = 1e-5  # relative, every iteration
ROPE = ["--position-embedding-type", "rope"]
FULL = ("--recompute-granularity", "full")
SELECTIVE = ("--recompute-granularity", "selective")  # core_attn: the ring runs again in backward
INTERLEAVED = ("--num-layers-per-virtual-pipeline-stage", "1")
# (TP, CP, PP, DP), SP, positions, extra flags: every layout of the issue with RoPE (some with recompute or
# interleaving), two with learned positions
LAYOUTS = [
    ((1, 2, 1, 1), False, "rope", ()), ((1, 4, 1, 1), False, "rope", FULL), ((2, 2, 1, 1), True, "rope", SELECTIVE),
    ((1, 2, 2, 1), False, "rope", ()), ((1, 2, 1, 2), False, "rope", ()), ((2, 2, 2, 1), False, "rope", INTERLEAVED),
    ((1, 2, 1, 1), False, "learned", ()), ((1, 2, 1, 2), False, "learned", ()),
]


def cp_args(data, save, tp, cp, pp, dp, positions, sp=False, extra=(), iters=ITERS):
    # 4 layers, 8 sequences of 32 tokens per step (micro 2 at DP 1, micro 1 at DP 2), clipping.
    return tiny_pretrain_args(data, str(save), iters, "--num-layers", "4", "--micro-batch-size", str(2 // dp),
                              "--clip-grad", str(CLIP), "--tensor-model-parallel-size", str(tp),
                              "--context-parallel-size", str(cp), "--pipeline-model-parallel-size", str(pp),
                              *(ROPE if positions == "rope" else []), *(["--sequence-parallel"] if sp else []),
                              *extra)


def broken(seam: str):
    """A context manager that breaks CP one way for the runs inside it (see the module docstring)."""
    import contextlib

    from codegeex_train.context_parallel import ring_attention as ring
    from codegeex_train.distributed import topology
    from codegeex_train.training import batches

    @contextlib.contextmanager
    def patched(owner, name, value):
        real = getattr(owner, name)
        setattr(owner, name, value(real))
        try:
            yield
        finally:
            setattr(owner, name, real)

    if seam == "unbalanced":  # contiguous halves of the sequence instead of chunks r and 2N-1-r
        def contiguous(real):
            return lambda t, dim, rank, size: t.chunk(size, dim=dim)[rank] if size > 1 else t
        return patched(batches, "split_for_context_parallel", contiguous)
    if seam == "no_lse":  # partial results added without the log-sum-exp rescaling
        import torch

        return patched(ring, "_merge", lambda real: lambda out, lse, block_out, block_lse: (
            out + block_out, torch.logaddexp(lse, block_lse)))
    if seam == "dp_only":  # DeepSpeed reduces gradients over DP alone, as if CP were not data-parallel
        stack = contextlib.ExitStack()
        mpu = topology.DeepSpeedMPU
        stack.enter_context(patched(mpu, "get_data_parallel_group", lambda real: lambda self: self.topology.dp_group))
        stack.enter_context(patched(mpu, "get_data_parallel_world_size",
                                    lambda real: lambda self: self.topology.dims.dp_size))
        stack.enter_context(patched(mpu, "get_data_parallel_rank", lambda real: lambda self: self.topology.dp_rank))
        stack.enter_context(patched(pretrain, "build_deepspeed_config", lambda real: lambda args, plan, user: {
            **real(args, plan, user), "train_batch_size": plan.global_batch_size}))  # DeepSpeed's batch check
        return stack
    raise ValueError(seam)


def train_runs(topology, runs):
    """``pretrain.main`` once per (argv, seam) of ``runs`` on these ranks; returns what each run's model was built
    with."""
    import contextlib

    real_train = pretrain.train
    seen = []

    def train(run, *args, **kwargs):
        seen.append({"cp_size": run.plan.cp_size, "p2p_shape": tuple(run.p2p.shape),
                     "rope": run.model.position_embedding_type == "rope", "chunks": run.plan.num_chunks,
                     "recompute": run.engine.module.recompute.describe(), "seed": torch.initial_seed(),
                     "tp_rank": run.topology.tp_rank, "cp_rank": run.topology.cp_rank,
                     "pp_rank": run.topology.pp_rank})
        return real_train(run, *args, **kwargs)

    pretrain.train = train
    try:
        for argv, seam in runs:
            with broken(seam) if seam else contextlib.nullcontext():
                pretrain.main(argv)
    finally:
        pretrain.train = real_train
    return seen


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, tiny_data):
    """(1,1,1,1) with RoPE and with learned positions, in one spawn."""
    root = tmp_path_factory.mktemp("cp_base")
    runs = [(cp_args(tiny_data, root / positions, 1, 1, 1, 1, positions), None) for positions in ("rope", "learned")]
    run_distributed(train_runs, world_size=1, deadline_s=600, runs=runs)
    return {positions: metrics_records(root / positions) for positions in ("rope", "learned")}


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory, tiny_data):
    """Every layout of LAYOUTS, one spawn per world size: (layout, sp, positions) -> (metrics, what the ranks saw)."""
    root = tmp_path_factory.mktemp("cp_layouts")
    out = {}
    by_world: dict[int, list] = {}
    for key in LAYOUTS:
        tp, cp, pp, dp = key[0]
        by_world.setdefault(tp * cp * pp * dp, []).append(key)
    name = lambda key: f"{'_'.join(map(str, key[0]))}_{key[1]}_{key[2]}_{len(key[3])}"  # noqa: E731
    for world, layouts in by_world.items():
        # One spawn runs layouts of different TP/CP/PP: pretrain builds its topology from each run's flags.
        runs = [(cp_args(tiny_data, root / name(key), *key[0], key[2], key[1], key[3]), None) for key in layouts]
        seen = run_distributed(train_runs, world_size=world, deadline_s=900, runs=runs)
        for i, key in enumerate(layouts):
            out[key] = metrics_records(root / name(key)), [s[i] for s in seen]
    return out


def test_baseline_clips_learns_and_rope_changes_the_model(baseline):
    rope, learned = baseline["rope"], baseline["learned"]
    assert sorted(rope) == list(range(1, ITERS + 1))
    assert rope[ITERS]["loss"] < rope[1]["loss"]  # it learns
    assert max(rope[it]["grad_norm"] for it in rope) > CLIP  # clipping is active
    assert rope[1]["loss"] != learned[1]["loss"]  # the flag reached the model


@pytest.mark.parametrize("layout,sp,positions,extra", LAYOUTS,
                         ids=["x".join(map(str, l)) + ("-sp" if sp else "") + f"-{pos}" + "".join(e[1:2]) for
                              l, sp, pos, e in LAYOUTS])
def test_context_parallel_matches_single_process(baseline, layout_runs, layout, sp, positions, extra):
    base = baseline[positions]
    run, seen = layout_runs[(layout, sp, positions, extra)]
    tp, cp, pp, dp = layout
    for s in seen:  # every rank's run really was CP, with the activation shape of its share, as asked
        assert s["cp_size"] == cp and s["rope"] == (positions == "rope")
        assert s["p2p_shape"] == (2 // dp, 32 // cp // (tp if sp else 1), 32)
        assert s["chunks"] == (2 if extra == INTERLEAVED else 1)
        assert s["recompute"].split(" ")[0] == {FULL: "full", SELECTIVE: "selective"}.get(extra, "none")
    # Dropout streams: shared by the TP ranks of a CP rank (replicated dropout), different between CP ranks
    for stage in range(pp):
        seeds = {(s["tp_rank"], s["cp_rank"]): s["seed"] for s in seen if s["pp_rank"] == stage}
        assert all(seeds[(t, c)] == seeds[(0, c)] for t, c in seeds)
        assert len({seeds[(0, c)] for c in range(cp)}) == cp
    assert sorted(run) == list(range(1, ITERS + 1))
    for it in range(1, ITERS + 1):
        for key in ("loss", "grad_norm"):
            assert run[it][key] == pytest.approx(base[it][key], rel=TOL), (it, key)
    loss, grad_norm = worst_relative(run, base, "loss"), worst_relative(run, base, "grad_norm")
    print(f"{layout} sp={sp} {positions} {' '.join(extra)}: worst relative loss {loss:.2g}, grad norm {grad_norm:.2g}")


def test_broken_context_parallel_is_caught(tmp_path, tiny_data, baseline):
    """CP 2 with each of the three seams: the parity above fails (the losses leave the 1e-5 band)."""
    base = baseline["rope"]
    seams = ("unbalanced", "no_lse", "dp_only")
    runs = [(cp_args(tiny_data, tmp_path / seam, 1, 2, 1, 1, "rope"), seam) for seam in seams]
    run_distributed(train_runs, world_size=2, deadline_s=600, runs=runs)
    for seam in seams:
        run = metrics_records(tmp_path / seam)
        loss = worst_relative(run, base, "loss")
        print(f"{seam}: worst relative loss {loss:.3g}")
        assert loss > TOL, (seam, loss)


SAVED_AT = 3
DROPOUT = ("--hidden-dropout", "0.1", "--attention-dropout", "0.1")


def train_then_resume(topology, full_argv, resumed_argv, full, resumed):
    """Train ``full_argv`` (saving at SAVED_AT), cut its checkpoint at SAVED_AT, resume it with ``resumed_argv``."""
    import torch.distributed as dist

    pretrain.main(full_argv)
    if topology.rank == 0:
        checkpoint_at(full, resumed, SAVED_AT)
    dist.barrier()
    pretrain.main(resumed_argv)


def test_context_parallel_resume_with_dropout_is_bitwise_exact(tmp_path, tiny_data):
    """CP 2, RoPE, hidden and attention dropout on: every stream (the per-CP-rank default and TP streams, the ring's
    attention-dropout draws) continues where the interrupted run left it."""
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    args = lambda save, *extra: cp_args(tiny_data, save, 1, 2, 1, 1, "rope", extra=(  # noqa: E731
        *DROPOUT, "--save-interval", str(SAVED_AT), *extra))
    run_distributed(train_then_resume, world_size=2, deadline_s=600, full_argv=args(full),
                    resumed_argv=args(resumed, "--load", str(resumed)), full=str(full), resumed=str(resumed))
    a, b = metrics_records(full), metrics_records(resumed)
    assert sorted(b) == list(range(SAVED_AT + 1, ITERS + 1))
    for it in b:
        assert (b[it]["loss"], b[it]["grad_norm"]) == (a[it]["loss"], a[it]["grad_norm"]), it


def test_context_parallel_checkpoints_resume_without_cp_and_back(tmp_path, tiny_data):
    """CP changes no parameter, but DeepSpeed's ZeRO partitions span DP x CP: a CP 2 checkpoint resumes at CP 1 and a
    CP 1 checkpoint at CP 2 through the universal format, each resumed iteration as the uninterrupted run logged it."""
    convert = load_tool("convert_checkpoint").main
    args = lambda save, cp, *extra: cp_args(tiny_data, save, 1, cp, 1, 1, "rope", extra=(  # noqa: E731
        "--save-interval", str(SAVED_AT), *extra))

    def universal(cp: int) -> str:  # run cp<cp>'s checkpoint at SAVED_AT, converted
        out = str(tmp_path / f"cp{cp}_universal")
        convert(["--load", checkpoint_at(tmp_path / f"cp{cp}", tmp_path / f"cp{cp}_at_save", SAVED_AT),
                 "--to-universal", out])
        return out

    # Three spawns: CP 1 trains; CP 2 trains, then resumes CP 1's checkpoint; CP 1 resumes CP 2's.
    run_distributed(run_pretrain, world_size=1, deadline_s=600, argv=args(tmp_path / "cp1", 1))
    run_distributed(train_runs, world_size=2, deadline_s=600,
                    runs=[(args(tmp_path / "cp2", 2), None),
                          (args(tmp_path / "cp1_resumed_at_cp2", 2, "--load", universal(1)), None)])
    run_distributed(run_pretrain, world_size=1, deadline_s=600,
                    argv=args(tmp_path / "cp2_resumed_at_cp1", 1, "--load", universal(2)))
    for saved, resumed_cp in ((2, 1), (1, 2)):
        resumed = metrics_records(tmp_path / f"cp{saved}_resumed_at_cp{resumed_cp}")
        reference = metrics_records(tmp_path / f"cp{saved}")
        assert sorted(resumed) == list(range(SAVED_AT + 1, ITERS + 1))
        for it in resumed:
            assert resumed[it]["consumed_samples"] == reference[it]["consumed_samples"]
            for key in ("loss", "grad_norm"):
                assert resumed[it][key] == pytest.approx(reference[it][key], rel=TOL), (saved, it, key)
