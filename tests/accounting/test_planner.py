"""The layout planner (codegeex_train/accounting/planner.py): its parameter counts are a real model's, it lists
exactly the layouts training would accept, it ranks by its estimate, and its CLI prints a table or one error line.
No process group: TP > 1 models are built on the meta device with the group size faked."""

from dataclasses import replace

import pytest
import torch.distributed as dist

from codegeex_train.accounting.planner import (
    Hardware,
    chunk_counts,
    estimate_layout,
    from_preset,
    main,
    rank_layouts,
)
from codegeex_train.accounting.theory import Workload, stage_parameters
from codegeex_train.config.arguments import parse_args, validate
from codegeex_train.config.model_config import ModelConfig
from codegeex_train.layout.recompute import Recompute
from codegeex_train.layout.plan import ParallelPlan
from codegeex_train.layout.dims import ParallelDims
from codegeex_train.layout.errors import LayoutError
from codegeex_train.model import CodeGeeXModel, ModelGroups
from codegeex_train.model.flops import model_flops_per_iteration
from codegeex_train.layout.stages import stage_layer_ranges

TINY = dict(num_layers=5, hidden_size=64, num_attention_heads=4, max_position_embeddings=32, vocab_size=300)


def _sizes(row):
    """(TP, PP, DP, micro-batch) of a planner row."""
    d = row.plan.dims
    return d.tp_size, d.pp_size, d.dp_size, row.plan.micro_batch_size


def _layout(row):
    """A row's layout: its plan without the options (sequence parallelism, recompute) that tell rows apart."""
    return replace(row.plan, sequence_parallel=False, recompute=Recompute())


def _pipeline(pp, stage_layers=None, seq_length=16, num_layers=TINY["num_layers"]):
    """A layout of one DP rank over ``pp`` stages, one micro-batch of one sample."""
    return ParallelPlan.derive(ParallelDims(pp, pp_size=pp), micro_batch_size=1, num_layers=num_layers,
                               stage_layers=stage_layers, seq_length=seq_length)


def _stage_numel(config, tp, pp_rank, layers, monkeypatch):
    """Parameters of one rank of one stage, counted on a real CodeGeeXModel (meta device)."""
    group = None
    if tp > 1:  # mappings.group_size/group_rank ask torch.distributed: answer as rank 1 of a TP group
        group = object()
        monkeypatch.setattr(dist, "get_world_size", lambda g=None: tp)
        monkeypatch.setattr(dist, "get_rank", lambda g=None: 1)
    model = CodeGeeXModel(config, ModelGroups(tp=group), pre_process=pp_rank == 0,
                          post_process=pp_rank == len(layers) - 1, layer_numbers=layers[pp_rank], device="meta")
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("tp,pp", [(1, 1), (1, 2), (1, 3), (2, 1), (4, 2)])
def test_parameter_counts_are_the_models(tp, pp, monkeypatch):
    config = ModelConfig(**TINY)
    row = estimate_layout(config, Hardware(world_size=tp * pp), seq_length=16, global_batch_size=4, tp=tp, pp=pp,
                          micro_batch_size=1)
    assert sum(row.layer_counts) == 5 and len(row.layer_counts) == pp
    w = Workload(model=config, plan=row.plan)
    counts = []
    for i in range(pp):
        # the split the planner chose, as training's --decoder-first/last-pipeline-num-layers would make it
        ranges = stage_layer_ranges(5, pp, *_first_last(row))
        counts.append(_stage_numel(config, tp, i, ranges, monkeypatch))
        assert stage_parameters(w, i) == counts[-1], (tp, pp, i)
    assert row.parameters == max(counts)


def _first_last(row):
    flags = dict(zip(row.split_flags[::2], map(int, row.split_flags[1::2])))
    return flags.get("--decoder-first-pipeline-num-layers"), flags.get("--decoder-last-pipeline-num-layers")


def test_uneven_splits_are_ones_training_accepts():
    model, cluster, kw = from_preset("codegeex-13b")
    for pp in (2, 3, 4, 6):
        row = estimate_layout(model, cluster, tp=8, pp=pp, micro_batch_size=1, recompute=Recompute.full(), **{
            **kw, "global_batch_size": 1536 // pp})
        assert tuple(stage_layer_ranges(39, pp, *_first_last(row))) == row.plan.stage_layers
    # the last stage also runs the top query layer and the logits (~1.8 layers): it gets fewer layers
    assert row.layer_counts[-1] < row.layer_counts[0]


def test_workload_refuses_a_split_that_loses_layers():
    config = ModelConfig(**TINY)  # 5 layers
    even = Workload(config, _pipeline(5))  # even by default, written into the layout
    assert [even.layers_on(i) for i in range(5)] == [1] * 5 and even.plan.stage_layers[4] == range(4, 5)
    assert Workload(config, _pipeline(2, (range(0, 3), range(3, 5)))).layers_on(1) == 2
    for pp, stage_layers in ((2, ()),  # 5 layers do not split evenly over 2
                             (2, (range(0, 2), range(2, 4))),  # layer 4 on no stage
                             (2, (range(0, 2), range(3, 6))),  # five layers, but layer 2 on none
                             (3, (range(0, 3), range(3, 5)))):  # two ranges for three stages
        with pytest.raises(LayoutError, match="--num-layers 5"):
            _pipeline(pp, stage_layers)  # the plan's rule (layout/plan.py): no such plan
    for plan in (_pipeline(2, num_layers=4),  # another model's split: layer 4 on no stage
                 _pipeline(2, (range(0, 3), range(3, 6)), num_layers=6),  # a sixth layer
                 ParallelPlan.derive(ParallelDims(2, pp_size=2), micro_batch_size=1, seq_length=16)):  # no split
        with pytest.raises(ValueError, match="do not split into"):
            Workload(config, plan)


def test_only_layouts_training_accepts_are_listed():
    # TP must divide heads 6, ffn 192, padded vocab 300 and the 4 GPUs of a node: 1 or 2 (3 spans the node,
    # 4 does not divide the heads); PP <= 3 layers; DP = 12 / (TP x PP); micro x DP divides the batch 12.
    model = ModelConfig(num_layers=3, hidden_size=48, num_attention_heads=6, ffn_hidden_size=192,
                        max_position_embeddings=32, vocab_size=300, make_vocab_size_divisible_by=4)
    cluster = Hardware(world_size=12, gpus_per_node=4, gpu_memory_gb=80)
    rows = rank_layouts(model, cluster, seq_length=16, global_batch_size=12)
    got = {(*_sizes(r), *r.options) for r in rows}
    expected = {(1, 1, 12, 1), (1, 2, 6, 1), (1, 2, 6, 2), (1, 3, 4, 1), (2, 1, 6, 1), (2, 1, 6, 2),
                (2, 2, 3, 1), (2, 2, 3, 2), (2, 2, 3, 4), (2, 3, 2, 1), (2, 3, 2, 2)}
    # each with no, selective and full recompute; with and without sequence parallelism where TP > 1
    assert got == {(*e, sp, rc) for e in expected for sp in ((False, True) if e[0] > 1 else (False,))
                   for rc in ("none", "selective", "full")}
    assert len(rows) == len(got)
    assert all(r.plan.global_batch_size == 12 for r in rows)
    given = rank_layouts(model, cluster, seq_length=16, global_batch_size=12, micro_batch_sizes=[3])
    assert {_sizes(r) for r in given} == {(1, 3, 4, 3), (2, 3, 2, 3)}
    # a memory limit between the layouts: the ones above it are listed after the ranked ones, unranked
    limit = sorted(r.memory_gb for r in rows)[len(rows) // 2]
    capped = rank_layouts(model, Hardware(world_size=12, gpus_per_node=4, gpu_memory_gb=limit), seq_length=16,
                          global_batch_size=12)
    fits = [r.memory_gb <= limit for r in capped]
    assert any(fits) and not all(fits) and fits == sorted(fits, reverse=True)
    assert all((r.rank > 0) == r.fits == (r.memory_gb <= limit) for r in capped)


def test_codegeex_13b_real_layout():
    model, cluster, kw = from_preset("codegeex-13b")
    whole = Workload(model, _pipeline(1, seq_length=2048, num_layers=model.num_layers))
    assert 12.8e9 < stage_parameters(whole, 0) < 13.5e9  # "13 billion parameters"
    rows = rank_layouts(model, cluster, **kw)
    real = {r.options: r for r in rows if _sizes(r) == (8, 1, 192, 16)}  # CodeGeeX: micro 16, batch 3,072
    assert set(real) == {(sp, rc) for sp in (False, True) for rc in ("none", "selective", "full")}
    own = real[False, "full"]  # what CodeGeeX ran: full recompute, no SP
    assert own.plan.num_microbatches == 1
    # Without recompute, 40 layers of micro-batch 16 activations (~3.7 GiB each) cannot fit 32 GB;
    # with it the weights (1.6 B/rank, fp16), ZeRO-2's slices over 192 ranks and the kept layer inputs do.
    assert not real[False, "none"].fits and real[False, "none"].memory_gb > 100
    assert own.fits and 15 < own.memory_gb < 32
    assert own.rank > 0 and own.comm_bytes["pp"] == 0 and own.bubble_fraction == 0
    # No fused attention on that machine: selective recompute drops the s x s terms (5as/(ht) = 10 sbh per layer
    # at TP 8, of 23 sbh), SP divides the other 13 sbh's replicated 10 by 8; together the paper's "5x" (34/8 sbh
    # left). SP + full halves the memory of CodeGeeX's layout. SP moves more TP bytes (the re-gathers), selective
    # no more.
    none, sp, selective, both = (real[k].memory_parts["activations"] for k in
                                 ((False, "none"), (True, "none"), (False, "selective"), (True, "selective")))
    assert 1.7 < none / selective < 1.8 and 1.55 < none / sp < 1.65 and 5 < none / both < 5.5
    assert real[True, "full"].memory_gb < own.memory_gb / 2 and real[True, "full"].fits
    assert real[True, "none"].comm_bytes["tp"] > real[False, "none"].comm_bytes["tp"]
    assert real[False, "selective"].comm_bytes == real[False, "none"].comm_bytes
    # SP + selective at micro 8 fits and beats CodeGeeX's own layout: no recomputed forward
    sp_selective = next(r for r in rows if _sizes(r) == (8, 1, 192, 8) and r.options == (True, "selective"))
    assert sp_selective.fits and sp_selective.step_time < own.step_time


def test_ranked_by_estimated_step_time():
    model, cluster, kw = from_preset("codegeex-13b")
    rows = rank_layouts(model, cluster, **kw)
    ranked = [r for r in rows if r.rank]
    assert [r.rank for r in ranked] == list(range(1, len(ranked) + 1)) and len(ranked) > 10
    times = [r.step_time for r in ranked]
    assert times == sorted(times) and times[0] < times[-1]
    for r in ranked:
        assert r.step_time == pytest.approx(sum(r.time_parts.values()))
        # the compute part is flops.py's count spread over every GPU at the assumed efficiency; selective
        # recompute adds the attention core's forward (QK^T and x V: 4 b s^2 h per layer and sequence)
        flops = model_flops_per_iteration(model, kw["global_batch_size"], kw["seq_length"], r.checkpoint_activations)
        if r.recompute_name == "selective":
            flops += (model.num_layers + 1) * 4 * kw["global_batch_size"] * kw["seq_length"] ** 2 * model.hidden_size
        assert r.time_parts["compute"] == pytest.approx(flops / (1536 * 256e12 * 0.5))
        p, v, m = r.plan.dims.pp_size, r.num_chunks, r.plan.num_microbatches
        assert r.bubble_fraction == pytest.approx((p - 1) / (v * m))
    # faster links never make a layout slower; slower ones hurt the ones that cross nodes
    fast = {(r.plan, r.options): r.step_time
            for r in rank_layouts(model, Hardware(**{**vars(cluster), "inter_node_gbps": 800}), **kw)}
    assert all(fast[(r.plan, r.options)] <= r.step_time for r in rows)
    # at the same layout: selective costs less time than full recompute, and SP no less than none
    by_key = {(_layout(r), r.options): r for r in rows}
    for (layout, (sp, rc)), r in by_key.items():
        if rc == "selective":
            assert r.time_parts["compute"] < by_key[layout, (sp, "full")].time_parts["compute"]
        if sp:
            assert r.time_parts["tp"] >= by_key[layout, (False, rc)].time_parts["tp"]


def test_cli_prints_the_table(capsys):
    main(["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--vocab-size", "300",
          "--seq-length", "32", "--max-position-embeddings", "32", "--global-batch-size", "16", "--world-size", "16",
          "--gpus-per-node", "4", "--top", "5"])
    lines = capsys.readouterr().out.splitlines()
    header = lines.index(next(line for line in lines if line.split()[:4] == ["#", "TP", "PP", "v"]))
    table = [line for line in lines[header + 1:] if not line.startswith("v > 1")]
    assert len(table) == 5 and [int(line.split()[0]) for line in table] == [1, 2, 3, 4, 5]
    assert "layouts fit" in lines[1] and "vocab 384 (padded)" in lines[0]
    assert lines[header].split()[2:4] == ["PP", "v"] and lines[header].split()[7:9] == ["SP", "recompute"]
    # the filters keep the global rank: TP 2 with SP and selective recompute only
    main(["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--vocab-size", "300",
          "--seq-length", "32", "--max-position-embeddings", "32", "--global-batch-size", "16", "--world-size", "16",
          "--gpus-per-node", "4", "--tensor-model-parallel-size", "2", "--sequence-parallel", "yes",
          "--recompute-granularity", "selective", "--top", "100"])
    lines = capsys.readouterr().out.splitlines()
    table = lines[lines.index(next(line for line in lines if line.split()[:4] == ["#", "TP", "PP", "v"])) + 1:]
    table = [line for line in table if not line.startswith("v > 1")]
    assert table and all(line.split()[1] == "2" and line.split()[7:9] == ["yes", "selective"] for line in table)


def test_interleaving_only_where_megatron_allows_it():
    """v > 1 needs PP > 1, micro-batches per step divisible by PP and the layers in p x v even chunks."""
    assert chunk_counts(8, 2, 4) == [1, 2, 4] and chunk_counts(8, 2, 3) == [1] and chunk_counts(8, 1, 4) == [1]
    assert chunk_counts(39, 3, 6) == [1, 13] and chunk_counts(39, 4, 4) == [1] and chunk_counts(12, 3, 3) == [1, 2, 4]
    model = ModelConfig(num_layers=8, hidden_size=64, num_attention_heads=4, max_position_embeddings=32,
                        vocab_size=300)
    rows = rank_layouts(model, Hardware(world_size=8, gpus_per_node=8), seq_length=32, global_batch_size=16)
    interleaved = [r for r in rows if r.num_chunks > 1]
    assert {r.num_chunks for r in interleaved} == {2, 4} and all(r.split_flags == [] for r in interleaved)
    for r in rows:
        p, m, v = r.plan.dims.pp_size, r.plan.num_microbatches, r.num_chunks
        assert v in chunk_counts(8, p, m) and r.bubble_fraction == pytest.approx((p - 1) / (v * m))
    for r in interleaved:  # its flags give training exactly its layout
        d = r.plan.dims
        argv = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
                "--max-position-embeddings", "32", "--data-path", "x",
                "--tensor-model-parallel-size", str(d.tp_size), "--pipeline-model-parallel-size", str(d.pp_size),
                "--micro-batch-size", str(r.plan.micro_batch_size), "--global-batch-size", "16", *r.flags,
                "--bf16"]  # the planner's 2-byte dtype, which the plan records
        assert validate(parse_args(argv), 8) == r.plan, r.flags


def test_interleaving_trades_bubble_for_bytes_and_memory():
    """Same layout, v = 1 (even split) against v = 2: the bubble's time halves, PP bytes triple at PP 2 (2mv - m
    against m per stage), the activations in flight grow."""
    model = ModelConfig(num_layers=8, hidden_size=64, num_attention_heads=4, max_position_embeddings=32,
                        vocab_size=300)
    kw = dict(seq_length=32, global_batch_size=16, tp=1, pp=2, micro_batch_size=2)
    one = estimate_layout(model, Hardware(world_size=2), stage_layers=(4, 4), **kw)
    two = estimate_layout(model, Hardware(world_size=2), num_chunks=2, **kw)
    assert two.plan.stage_layers == ((0, 1, 4, 5), (2, 3, 6, 7)) and two.flags[:2] == [
        "--num-layers-per-virtual-pipeline-stage", "2"]
    assert two.comm_bytes["pp"] == 3 * one.comm_bytes["pp"] and two.bubble_fraction == one.bubble_fraction / 2
    assert two.time_parts["bubble"] < one.time_parts["bubble"] and two.time_parts["pp"] > one.time_parts["pp"]
    assert two.memory_parts["activations"] > one.memory_parts["activations"]


def test_cli_names_the_interleaving_flag(capsys):
    main(["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4", "--vocab-size", "300",
          "--seq-length", "32", "--max-position-embeddings", "32", "--global-batch-size", "16", "--world-size", "8",
          "--num-layers-per-virtual-pipeline-stage", "2", "--top", "100"])
    lines = capsys.readouterr().out.splitlines()
    table = lines[lines.index(next(line for line in lines if line.split()[:4] == ["#", "TP", "PP", "v"])) + 1:-1]
    # only chunks of 2 layers: PP 2 with v 2 (PP 4 would give v 1)
    assert table and all(line.split()[2:4] == ["2", "2"] for line in table)
    assert lines[-1] == ("v > 1: interleaved 1F1B, trained with --num-layers-per-virtual-pipeline-stage N = layers / "
                         "(PP x v): PP 2 v 2: N 2")


@pytest.mark.parametrize("argv,names", [
    (["--config", "codegeex-13b", "--world-size", "0"], "--world-size"),
    (["--config", "codegeex-13b", "--tp", "8"], "--tp"),
    (["--config", "codegeex-13b", "--num-attention-heads", "48"], "--num-attention-heads"),
    (["--config", "codegeex-13b", "--seq-length", "4096"], "--seq-length"),
    (["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--vocab-size", "300",
      "--seq-length", "32", "--global-batch-size", "16"], "--world-size"),
    (["--config", "codegeex-13b", "--efficiency", "50"], "--efficiency"),
])
def test_bad_flag_is_one_error_line(argv, names, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "error:" in err[0] and names in err[0], err
