"""The Hugging Face families' presets (configs/deepseek-coder-6.7b.yaml, qwen2.5-coder-{1.5b,7b}.yaml,
starcoder2-{7b,15b}.yaml): their shapes give the published parameter counts, the planner and the GPU check read the
same model as pretraining does, and TP sizes that do not divide the key-value groups are refused in one line."""

import sys
from dataclasses import replace
from pathlib import Path

import pytest

from codegeex_train.accounting.planner import candidate_layouts, from_preset, main
from codegeex_train.accounting.theory import Workload, stage_parameters
from codegeex_train.config.arguments import parse_args
from codegeex_train.config.config_file import CONFIGS_DIR
from codegeex_train.layout.dims import ParallelDims
from codegeex_train.layout.plan import ParallelPlan

ROOT = Path(__file__).resolve().parents[2]
# preset -> (parameters, of which outside the word table and output layer, the TP sizes an 8-GPU node allows, the
# table's rows: config.json's vocab_size, which the tokenizer's ids are padded to).
# Qwen2.5-Coder: the model cards' "Number of Parameters" (7.61B, 1.54B) and "(Non-Embedding)" (6.53B, 1.31B);
# StarCoder2: the hub checkpoints' sizes (7B: 14.35 GB of bf16 = 7.17B; 15B: 63.8 GB of fp32 = 15.95B);
# DeepSeek-Coder: its name (6.7B).
PUBLISHED = {
    "deepseek-coder-6.7b": (6.7e9, None, {1, 2, 4, 8}, 32256),
    "qwen2.5-coder-1.5b": (1.54e9, 1.31e9, {1, 2}, 151936),
    "qwen2.5-coder-7b": (7.61e9, 6.53e9, {1, 2, 4}, 152064),
    "starcoder2-7b": (7.17e9, None, {1, 2, 4}, 49152),
    "starcoder2-15b": (15.95e9, None, {1, 2, 4}, 49152),
}


def _whole(model):
    plan = ParallelPlan.derive(ParallelDims(1), micro_batch_size=1, num_layers=model.num_layers, seq_length=1024)
    return stage_parameters(Workload(model, plan), 0)


@pytest.mark.parametrize("preset", PUBLISHED)
def test_presets_give_the_published_sizes(preset):
    model, _, _ = from_preset(preset)
    total, non_embedding, _, rows = PUBLISHED[preset]
    assert model.padded_vocab_size == rows  # what --from-hf imports: the tokenizer's ids padded to the table's rows
    n = _whole(model)
    assert n == pytest.approx(total, rel=0.01), n
    if non_embedding is not None:
        tables = model.padded_vocab_size * model.hidden_size * (1 if model.tied_output else 2)
        assert n - tables == pytest.approx(non_embedding, rel=0.01)


@pytest.mark.parametrize("preset", PUBLISHED)
def test_pretraining_the_planner_and_the_gpu_check_read_one_model(preset):
    """The model pretraining parses from the preset is the planner's (with the planner's vocabulary) and the GPU
    check's (at its measured sequence)."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.gpu import parse as gpu_check_args
    from benchmarks.gpu_check.mfu import c_model

    trained = parse_args(["--config", str(CONFIGS_DIR / f"{preset}.yaml")]).model
    planned, _, kw = from_preset(preset)
    assert replace(trained, vocab_size=planned.vocab_size) == planned
    checked = c_model(gpu_check_args(["--config", preset]))
    assert replace(trained, vocab_size=checked.vocab_size, max_position_embeddings=kw["seq_length"]) == checked
    assert planned.vocab_size == checked.vocab_size and planned.padded_vocab_size == PUBLISHED[preset][3]


@pytest.mark.parametrize("preset", PUBLISHED)
def test_planner_lists_the_tp_sizes_the_groups_allow(preset):
    model, cluster, kw = from_preset(preset)
    tps = {tp for tp, *_ in candidate_layouts(model, cluster, kw["seq_length"], kw["global_batch_size"],
                                               micro_batch_sizes=[1], cp_sizes=[1])}
    assert tps == PUBLISHED[preset][2]


@pytest.mark.parametrize("preset,tp,groups,largest", [("starcoder2-15b", 8, 4, 4), ("qwen2.5-coder-1.5b", 4, 2, 2)])
def test_planner_refuses_a_tp_above_the_groups_in_one_line(capsys, preset, tp, groups, largest):
    """The heads divide by TP, the key-value groups do not: training's one line (layout/plan.py), naming the
    largest TP."""
    with pytest.raises(SystemExit) as e:
        main(["--config", preset, "--tensor-model-parallel-size", str(tp)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"--num-query-groups {groups} is not divisible by --tensor-model-parallel-size {tp}" in err
    assert f"the largest TP size for {groups} groups here is {largest}" in err
