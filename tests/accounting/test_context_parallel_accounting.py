"""Context parallelism in the accounting (codegeex_train/accounting/theory.py, planner.py, fit.py), with no process
group: CP 1 predicts exactly what it did before CP existed; the "cp" bytes are a hand count of the ring's hops; every
per-token term follows s/n and attention keeps no s x s block; RoPE's parameters and saved tensors are a real
model's; the planner lists CP where training accepts it, charges the ring's hops only where its blocks do not hide
them, and finds CodeGeeX-13B layouts at 16K and 32K tokens that need no recompute. Measured bytes and activations of
real CP runs: tests/accounting/test_context_parallel_runs.py."""

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from codegeex_train.accounting import available, fit
from codegeex_train.accounting.memory import SavedActivations
from codegeex_train.accounting.planner import (
    Hardware,
    context_parallel_sizes,
    estimate_layout,
    from_preset,
    rank_layouts,
    ring_exposed_seconds,
)
from codegeex_train.accounting.theory import (
    Workload,
    activation_bytes_per_microbatch,
    comm_bytes_per_step,
    expected_memory_report,
    memory_per_rank,
    ring_block_bytes,
    stage_parameters,
    tp_bytes_per_microbatch,
)
from codegeex_train.config.arguments import parse_args, validate
from codegeex_train.config.model_config import ModelConfig
from codegeex_train.layout.plan import ParallelPlan
from codegeex_train.layout.recompute import Recompute
from codegeex_train.layout.dims import ParallelDims
from codegeex_train.model.codegeex import CodeGeeXModel
from codegeex_train.tensor_parallel import model_parallel_seed

B, S, H, HEADS = 2, 32, 32, 4


def _tiny(layers=4, dropout=0.0, **kw):
    return ModelConfig(num_layers=layers, hidden_size=H, num_attention_heads=HEADS, max_position_embeddings=64,
                       vocab_size=256, make_vocab_size_divisible_by=64, hidden_dropout=dropout,
                       attention_dropout=dropout, **kw)


_13B = ModelConfig(num_layers=39, hidden_size=5120, num_attention_heads=40, ffn_hidden_size=20480,
                   max_position_embeddings=2048, vocab_size=52224)

# --- CP 1 is unchanged -----------------------------------------------------------------------------------------

# Before CP (main at 7764c38, the one-plan commit): per stage, comm_bytes_per_step (tp, pp, dp, embedding) and
# memory_per_rank (weights, gradients, optimizer, buffers, activations, recompute), computed by that commit's theory.py.
BEFORE = {
    "TP 2 PP 2, SP + selective": [((798720, 16384, 0, 32768), (76160, 76160, 228480, 76160, 266368, 512)),
                                  ((1239040, 16384, 0, 32768), (102208, 102208, 306624, 102208, 249216, 512))],
    "PP 2 DP 2, dropout": [((0, 16384, 778496, 65536), (142592, 71296, 213888, 142592, 1005568, 0)),
                           ((0, 16384, 1033856, 65536), (193664, 96832, 290496, 193664, 832384, 0))],
    "PP 2 v 2, dropout": [((0, 98304, 0, 65536), (142592, 142592, 427776, 142592, 1270784, 0)),
                          ((0, 98304, 0, 65536), (193664, 193664, 580992, 193664, 1079168, 0))],
    "TP 2 DP 2, full": [((1084416, 0, 809920, 0), (161984, 80992, 242976, 161984, 101056, 91648))],
    "TP 4 SP, block 1, CUDA": [((542208, 0, 0, 0), (91232, 91232, 273696, 91232, 170816, 34304))],
    "13B TP 8 DP 192, full": [((163075325952, 0, 9772062720, 0),
                               (3257354240, 133693440, 101792328, 1000000000, 15453224960, 4194828288))],
    "13B TP 4 PP 3 v 13, SP + selective": [
        ((66699018240, 3145728000, 29140231680, 534773760),
         (2200419840, 267386880, 103144680, 1000000000, 14682243072, 838860800)),
        ((65440727040, 3271557120, 26594813440, 0),
         (2045754880, 104857600, 95894760, 1000000000, 13905395712, 838860800)),
        ((73244295168, 3145728000, 31186252800, 534773760),
         (2357806080, 267386880, 110522160, 1000000000, 14102724608, 838860800))],
}
SELECTIVE = Recompute("selective")


def _case(model, dims, micro, m, device, **kw):
    """(model, its plan, device): the plan derived with the model's layers."""
    return model, ParallelPlan.derive(dims, micro_batch_size=micro, num_microbatches=m, num_layers=model.num_layers,
                                      **kw), device


BEFORE_CASES = {
    "TP 2 PP 2, SP + selective": _case(_tiny(), ParallelDims(4, 2, 2), 2, 4, "cpu", seq_length=32,
                                       sequence_parallel=True, recompute=SELECTIVE),
    "PP 2 DP 2, dropout": _case(_tiny(dropout=0.1), ParallelDims(4, 1, 2), 2, 2, "cpu", seq_length=32),
    "PP 2 v 2, dropout": _case(_tiny(dropout=0.1), ParallelDims(2, 1, 2), 2, 4, "cpu", num_chunks=2, seq_length=32),
    "TP 2 DP 2, full": _case(_tiny(), ParallelDims(4, 2, 1), 2, 2, "cpu", seq_length=32, recompute=Recompute.full()),
    "TP 4 SP, block 1, CUDA": _case(_tiny(dropout=0.1), ParallelDims(4, 4, 1), 2, 1, "cuda", seq_length=32,
                                    sequence_parallel=True, recompute=Recompute("full", "block", 1)),
    "13B TP 8 DP 192, full": _case(_13B, ParallelDims(1536, 8, 1), 16, 1, "unfused", seq_length=2048, dtype="bf16",
                                   recompute=Recompute.full()),
    "13B TP 4 PP 3 v 13, SP + selective": _case(_13B, ParallelDims(1536, 4, 3), 4, 6, "unfused", num_chunks=13,
                                                seq_length=2048, dtype="bf16", sequence_parallel=True,
                                                recompute=SELECTIVE),
}


@pytest.mark.parametrize("name", BEFORE)
def test_cp_1_predicts_what_it_did_before_cp(name):
    model, plan, device = BEFORE_CASES[name]
    w = Workload(model, plan, device=device)
    for pp_rank, (comm, memory) in enumerate(BEFORE[name]):
        got = comm_bytes_per_step(w, pp_rank)
        assert list(got) == ["tp", "pp", "dp", "embedding"] and tuple(got.values()) == comm, (name, pp_rank)
        parts = memory_per_rank(w, pp_rank).as_dict()
        assert list(parts) == ["weights", "gradients", "optimizer", "buffers", "activations", "recompute", "total"]
        assert tuple(parts.values())[:-1] == memory, (name, pp_rank)
    assert "CP" not in expected_memory_report(w) and "ring" not in expected_memory_report(w)


# --- the ring's bytes -------------------------------------------------------------------------------------------

def _cp_workload(model, cp, tp=1, pp=1, dp=1, m=2, seq=S, device="cpu", **kw):
    plan = ParallelPlan.derive(ParallelDims(tp * cp * pp * dp, tp, pp, cp), micro_batch_size=B, num_microbatches=m,
                               num_layers=model.num_layers, seq_length=seq, hidden_size=H, **kw)
    return Workload(model, plan, device=device)


def ring_hand_count(n, t, attentions, reruns, e=4, seq=S):
    """Per micro-batch, the ring of n ranks written out hop by hop: each rank's K and V (b, a/t, s/n, d) travel n - 1
    hops forward; in backward n - 1 hops again and the dK/dV sums n hops (the last one home); a recomputed attention
    repeats the forward's hops."""
    kv = 2 * B * (HEADS // t) * (seq // n) * (H // HEADS) * e
    return attentions * ((n - 1) * kv + (n - 1) * kv + n * kv) + reruns * (n - 1) * kv


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("tp,sp", [(1, False), (2, False), (2, True)])
def test_cp_bytes_are_the_rings_hops(n, tp, sp):
    """Stage 0 of PP 2 holds 2 regular layers, stage 1 the other 2 and the top query layer; recompute re-runs the
    forward ring of what it recomputes: selective every attention, full (uniform) every layer and the top query
    layer, full block 1 one layer per stage (and not the top query layer)."""
    model = _tiny()
    for rc, reruns in ((Recompute(), (0, 0)), (SELECTIVE, (2, 3)), (Recompute.full(), (2, 3)),
                       (Recompute("full", "block", 1), (1, 1))):
        w = _cp_workload(model, n, tp=tp, pp=2, m=3, seq=64, sequence_parallel=sp, recompute=rc)
        for stage, attentions in ((0, 2), (1, 3)):
            comm = comm_bytes_per_step(w, stage)
            assert comm["cp"] == 3 * ring_hand_count(n, tp, attentions, reruns[stage], seq=64), (rc, stage)
    assert "cp" not in comm_bytes_per_step(_cp_workload(model, 1, tp=tp, pp=2))


@pytest.mark.parametrize("n", [2, 4])
def test_tp_pp_and_zero_bytes_under_cp(n):
    """TP moves the rank's s/n tokens: the TP bytes of CP n at s are CP 1's at s/n; PP sends the plan's p2p_shape;
    ZeRO's traffic is in "dp_cp", the same as CP 1's with DP x CP data-parallel ranks, and nothing in "dp"."""
    model = _tiny()
    for sp in (False, True):
        w = _cp_workload(model, n, tp=2, pp=2, dp=2, seq=64, sequence_parallel=sp)
        short = _cp_workload(model, 1, tp=2, pp=2, dp=2, seq=64 // n, sequence_parallel=sp)
        wide = _cp_workload(model, 1, tp=2, pp=2, dp=2 * n, seq=64, sequence_parallel=sp)
        for stage in (0, 1):
            assert tp_bytes_per_microbatch(w, stage) == tp_bytes_per_microbatch(short, stage)
            comm = comm_bytes_per_step(w, stage)
            b, s, h = w.plan.p2p_shape
            assert s == 64 // n // (2 if sp else 1) and comm["pp"] == 2 * 1 * b * s * h * 4  # m 2, one send each way
            assert comm["dp"] == 0 and comm["dp_cp"] == comm_bytes_per_step(wide, stage)["dp"] > 0
            assert memory_per_rank(w, stage).optimizer == memory_per_rank(wide, stage).optimizer


# --- activations per rank -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [2, 4])
def test_activations_follow_the_local_sequence(n):
    """Fused attention on CPU: a CP n rank keeps what CP 1 keeps at s/n, plus per attention the ring's merged output
    (the dense layer's input is a copy of it): e (s/n) b h / t. About 1/n of CP 1's at s."""
    model = _tiny()
    for tp, sp, rc in ((1, False, Recompute()), (2, True, Recompute()), (2, False, Recompute.full())):
        w = _cp_workload(model, n, tp=tp, seq=64, sequence_parallel=sp, recompute=rc)
        short = _cp_workload(model, 1, tp=tp, seq=64 // n, sequence_parallel=sp, recompute=rc)
        kept = 0 if rc.is_full else (model.num_layers + 1) * 4 * (64 // n) * B * H // tp
        assert activation_bytes_per_microbatch(w) == activation_bytes_per_microbatch(short) + kept
        whole = activation_bytes_per_microbatch(_cp_workload(model, 1, tp=tp, seq=64, sequence_parallel=sp,
                                                             recompute=rc))
        assert 0.9 / n < activation_bytes_per_microbatch(w) / whole < 1.25 / n


def test_the_ring_keeps_no_s_squared_block():
    """With attention dropout CPU attention takes torch's math path and keeps s x s probabilities, its mask and the
    dropped probabilities: at CP 1 doubling s more than doubles a rank's activations. The ring keeps none of them
    (its masks are redrawn in backward): at CP 2 they double exactly. Its transient block (4 fp32 tensors of
    b a/t (s/n)^2, and a 1-byte mask and the dropped probabilities with dropout) is counted apart: ``ring_blocks``."""
    model = _tiny(dropout=0.1)
    one = [activation_bytes_per_microbatch(_cp_workload(model, 1, seq=s)) for s in (32, 64)]
    two = [activation_bytes_per_microbatch(_cp_workload(model, 2, seq=s)) for s in (32, 64)]
    assert one[1] > 2.5 * one[0] and two[1] == 2 * two[0]
    w = _cp_workload(model, 2, tp=2, seq=64)
    local = 32
    assert ring_block_bytes(w) == (4 * 4 + 1 + 4) * B * (HEADS // 2) * local * local
    assert ring_block_bytes(_cp_workload(_tiny(), 2, tp=2, seq=64)) == 16 * B * (HEADS // 2) * local * local
    parts = memory_per_rank(w)
    assert parts.ring_blocks == ring_block_bytes(w) and parts.as_dict()["ring_blocks"] == parts.ring_blocks
    assert parts.total == sum(v for k, v in parts.as_dict().items() if k != "total")
    report = expected_memory_report(w)
    assert "CP 2" in report and "ring attention over CP 2 (32 tokens per rank)" in report and "cp = ring" in report


# One block's backward in a fresh process: its peak resident memory above what it starts with (the 64 MiB block tensors
# are mmapped: freed at once, counted exactly by the high-water mark). The inputs and the merged lse are made row-chunk
# by row-chunk, so no block exists before; the dropout keep mask (1 byte an element, drawn inside the ring's step) is
# made before and added.
BLOCK_PEAK = """
import resource, sys, torch
from codegeex_train.context_parallel.ring_attention import _block_backward
b, n, L, d, p = 1, 4, 2048, 16, float(sys.argv[1])
q, k, v, dout = (torch.randn(b, n, L, d) for _ in range(4))
keep = torch.rand(b, n, L, L) >= p if p else None
lse = torch.cat([torch.logsumexp((torch.matmul(q[:, :, r:r + 256], k.transpose(-2, -1)) * d ** -0.5).masked_fill(
    torch.ones(256, L, dtype=torch.bool).triu(1 + r), float("-inf")), -1) for r in range(0, L, 256)], 2)
delta = torch.randn(b, n, L)
with open("/proc/self/statm") as f:
    base = int(f.read().split()[1]) * 4096
_block_backward(q, k, v, dout, lse, delta, True, d ** -0.5, keep, p)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base + (keep.numel() if p else 0))
"""


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_ring_block_bytes_are_the_blocks_measured_peak(dropout):
    """The ring's own block (4 heads, 2,048 local tokens: s 4,096 at CP 2) at its backward's peak, measured on CPU:
    4 fp32 block tensors, 5 and the 1-byte mask with attention dropout: ``ring_block_bytes``."""
    peak = int(subprocess.run([sys.executable, "-c", BLOCK_PEAK, str(dropout)], capture_output=True, text=True,
                              check=True, cwd=Path(__file__).resolve().parents[2]).stdout)
    model = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, max_position_embeddings=4096,
                        vocab_size=256, attention_dropout=dropout)
    plan = ParallelPlan.derive(ParallelDims(2, cp_size=2), micro_batch_size=1, num_layers=1, seq_length=4096)
    w = Workload(model, plan, device="cpu")
    assert peak == pytest.approx(ring_block_bytes(w), rel=0.05), peak / (4 * 4 * 2048 * 2048)


# --- RoPE: no position table, a one-row top query table ------------------------------------------------------------

@pytest.mark.parametrize("pp", [1, 2])
def test_rope_parameters_are_the_models(pp):
    model = _tiny(position_embedding_type="rope")
    w = Workload(model, ParallelPlan.derive(ParallelDims(pp, pp_size=pp), micro_batch_size=B,
                                            num_layers=model.num_layers, seq_length=S))
    for stage in range(pp):
        net = CodeGeeXModel(model, None, None, pre_process=stage == 0, post_process=stage == pp - 1,
                            layer_numbers=w.plan.stage_layers[stage], device="meta")
        assert stage_parameters(w, stage) == sum(p.numel() for p in net.parameters()), stage
    learned = Workload(_tiny(), w.plan)
    table, top_query = 64 * H, (64 - 1) * H  # the position table; the top query table's rows but one
    if pp == 1:
        assert stage_parameters(learned, 0) - stage_parameters(w, 0) == table + top_query
    else:
        assert stage_parameters(learned, 0) - stage_parameters(w, 0) == table
        assert stage_parameters(learned, 1) - stage_parameters(w, 1) == top_query


@pytest.mark.parametrize("recompute", [Recompute(), SELECTIVE, Recompute.full()], ids=["none", "selective", "full"])
@pytest.mark.parametrize("dropout,percent", [(0.0, 1.0), (0.1, 0.5)])
def test_rope_saved_activations_equal_theory(recompute, dropout, percent):
    """Measured with saved-tensor hooks on one CPU rank: the (cos, sin) tables once per forward, the top query
    lookup's zeros index, no position ids on the first stage; torch's CPU attention keeps its own q, k, v, so the
    rotation adds nothing there (the fused kernel without dropout, the math path with it)."""
    model = _tiny(layers=2, dropout=dropout, position_embedding_type="rope", rotary_percent=percent)
    plan = ParallelPlan.derive(ParallelDims(1), micro_batch_size=B, num_layers=2, seq_length=S, recompute=recompute)
    net = CodeGeeXModel(model, None, plan, model_parallel_seed(5, 0), seed=5).train()
    ids = torch.randint(0, 256, (B, S), generator=torch.Generator().manual_seed(1))
    with SavedActivations(net) as saved:
        loss = net(ids, torch.arange(S).repeat(B, 1), labels=ids)
    loss.mean().backward()
    w = Workload(model, plan, device="cpu")
    assert saved.bytes == activation_bytes_per_microbatch(w)


# --- the planner ----------------------------------------------------------------------------------------------------

def test_cp_sizes_the_planner_lists():
    assert context_parallel_sizes(2048, 1536) == [1, 2]  # at least 1,024 tokens a rank
    assert context_parallel_sizes(32768, 1536) == [1, 2, 4, 8, 16, 32]
    assert context_parallel_sizes(32768, 24) == [1, 2, 4, 8]  # powers of two dividing the GPUs
    assert context_parallel_sizes(2050, 64) == [1]  # 1,025 tokens a rank, but not 4 equal chunks
    assert context_parallel_sizes(6144, 64) == [1, 2, 4]
    assert context_parallel_sizes(32, 16) == [1]


def test_ring_hops_cost_only_what_their_blocks_do_not_hide():
    for n in (2, 4, 8):
        # no compute to hide behind: every hop exposed, as many as the bytes count (n - 1 forward, 2n - 1 backward)
        assert ring_exposed_seconds(1.0, 0.0, n) == pytest.approx((n - 1, 2 * n - 1))
        # blocks longer than two hops: only the last dK/dV hop home shows
        assert ring_exposed_seconds(1.0, 2.0, n) == pytest.approx((0.0, 1.0))
        times = [sum(ring_exposed_seconds(1.0, block, n)) for block in (0.0, 0.25, 0.5, 1.0, 2.0)]
        assert times == sorted(times, reverse=True)
    assert ring_exposed_seconds(1.0, 0.0, 1) == (0.0, 0.0)


def test_cp_rows_are_layouts_training_accepts():
    """Each CP row's flags give training exactly its plan; DP = world / (TP x CP x PP); SP where TP divides the
    rank's tokens."""
    model = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, max_position_embeddings=4096,
                        vocab_size=300)
    rows = rank_layouts(model, Hardware(world_size=8, gpus_per_node=8), seq_length=4096, global_batch_size=8)
    assert {r.cp_size for r in rows} == {1, 2, 4}
    for r in rows:
        d = r.plan.dims
        assert d.dp_size * d.tp_size * d.cp_size * d.pp_size == 8
        assert (r.comm_bytes["cp"] > 0) == (r.time_parts["cp"] > 0) == (d.cp_size > 1)
    for r in [r for r in rows if r.cp_size > 1][:12]:
        d = r.plan.dims
        argv = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "4096",
                "--max-position-embeddings", "4096", "--data-path", "x", "--tensor-model-parallel-size",
                str(d.tp_size), "--pipeline-model-parallel-size", str(d.pp_size), "--micro-batch-size",
                str(r.plan.micro_batch_size), "--global-batch-size", "8", *r.flags, *r.split_flags, "--bf16"]
        assert validate(parse_args(argv), 8) == r.plan, r.flags


def test_cp_traffic_and_time_in_a_row():
    """One layout at CP 1 and 2: the same FLOPs per GPU per step (half the tokens of twice the micro-batches), half
    the activations, and the ring's bytes."""
    model = ModelConfig(num_layers=4, hidden_size=256, num_attention_heads=8, max_position_embeddings=8192,
                        vocab_size=300)
    kw = dict(seq_length=8192, global_batch_size=8, tp=2, pp=1, micro_batch_size=1)
    one = estimate_layout(model, Hardware(world_size=8), **kw)
    two = estimate_layout(model, Hardware(world_size=8), cp=2, **kw)
    assert one.plan.num_microbatches * 2 == two.plan.num_microbatches  # DP 4 -> 2: twice the micro-batches
    assert two.time_parts["compute"] == pytest.approx(one.time_parts["compute"])  # the same FLOPs per GPU per step
    assert two.comm_bytes["cp"] > 0 == one.comm_bytes["cp"]
    assert two.memory_parts["activations"] < 0.6 * one.memory_parts["activations"]
    assert two.flags == ["--context-parallel-size", "2"]


# CodeGeeX-13B on its 1,536 devices (the preset: fp16, no fused attention, the Ascend links), with 80 GB each, as the
# README shows it: (sequence, TP, CP, micro-batch, SP, recompute) -> (GiB per GPU, seconds per step).
LONG = {
    (16384, 4, 1, 1, False, "selective"): (73.5, 45.12),  # the best without CP
    (16384, 2, 2, 1, False, "none"): (79.1, 35.80),  # the planner's first
    (16384, 2, 2, 1, True, "none"): (71.2, 36.80),
    (32768, 4, 1, 1, False, "full"): (78.3, 140.68),  # the best without CP
    (32768, 2, 4, 1, False, "none"): (79.5, 91.46),  # the planner's first
    (32768, 2, 4, 1, True, "none"): (71.6, 93.63),
}
RECOMPUTES = {"none": Recompute(), "selective": SELECTIVE, "full": Recompute.full()}


def _long(seq):
    model, cluster, kw = from_preset("codegeex-13b")
    return (replace(model, max_position_embeddings=seq), replace(cluster, gpu_memory_gb=80),
            {**kw, "seq_length": seq})


@pytest.mark.parametrize("layout", LONG)
def test_the_readme_long_context_rows(layout):
    seq, tp, cp, micro, sp, rc = layout
    model, cluster, kw = _long(seq)
    row = estimate_layout(model, cluster, tp=tp, pp=1, cp=cp, micro_batch_size=micro, sequence_parallel=sp,
                          recompute=RECOMPUTES[rc], **kw)
    assert row.fits and (round(row.memory_gb, 1), round(row.step_time, 2)) == LONG[layout]


def test_cp_makes_13b_fit_at_16k_without_recompute():
    """At 16K on 80 GB no CP 1 layout fits without recompute (its s x s probabilities: no fused attention there);
    with CP the first layouts keep everything and beat CP 1's best (selective recompute at TP 4) by a fifth."""
    model, cluster, kw = _long(16384)
    rows = rank_layouts(model, cluster, micro_batch_sizes=[1], **kw)
    fits = [r for r in rows if r.fits]
    assert not [r for r in fits if r.cp_size == 1 and r.recompute_name == "none"]
    first, best_cp_1 = fits[0], next(r for r in fits if r.cp_size == 1)
    assert first.cp_size > 1 and first.recompute_name == "none" and first.rank == 1
    assert first.step_time < 0.85 * best_cp_1.step_time and best_cp_1.recompute_name == "selective"


def test_32k_without_cp_needs_recompute():
    model, cluster, kw = _long(32768)
    for tp in (4, 8):
        for sp in (False, True):
            row = estimate_layout(model, cluster, tp=tp, pp=1, micro_batch_size=1, sequence_parallel=sp, **kw)
            assert not row.fits and row.memory_gb > 200, (tp, sp)  # 5 heads x 32K^2 x 5 bytes per layer at TP 8


# --- the memory check -----------------------------------------------------------------------------------------------

def test_the_memory_check_suggests_cp():
    """A long-sequence run that does not fit one GPU is told the CP that makes it fit, among the other fixes."""
    model = ModelConfig(num_layers=8, hidden_size=1024, num_attention_heads=16, max_position_embeddings=16384,
                        vocab_size=300, attention_dropout=0.0, hidden_dropout=0.0)
    plan = ParallelPlan.derive(ParallelDims(8), micro_batch_size=1, num_layers=8, seq_length=16384, hidden_size=1024,
                               dtype="bf16")
    w = Workload(model, plan, device="cuda")
    gpu = available.Available(int(fit.rank_need(w, 0).device * 0.6), "test's GPU")
    host = fit.Host(rank=0, local_world_size=8, local_rank=0, device="cuda")
    assert fit.shortfalls(w, host, 0, (None, None, gpu))
    fixes, _ = fit.suggestions(w, host, 0, (None, None, gpu))
    (cp,) = [f.split() for f in fixes if f.startswith("--context-parallel-size")]
    variant = fit._variant(w, 1, 1, 1, Recompute(), False, int(cp[1]))
    assert len(cp) == 2 and not fit.shortfalls(variant, host, 0, (None, None, gpu)), fixes
