"""Pipeline-parallel checkpoints: splitting the full state dict into stages, saving / loading / re-sharding
at any (TP, PP) with tools/convert_checkpoint.py, and chained stages computing the whole model's logits.
Single process: stage models are built with no TP group."""

from __future__ import annotations

import re

import pytest
import torch
from model_helpers import make_batch, max_err, tiny_config

from codegeex_train.checkpoint import load_full_state_dict, load_model_checkpoint, save_model_checkpoint
from codegeex_train.checkpoint.sharding import partition_spec, split_model_parallel, split_pipeline_stages
from codegeex_train.model import CodeGeeXModel
from codegeex_train.layout.stages import stage_layer_ranges

LAYOUTS = [(1, 2), (2, 2), (1, 4), (2, 1)]  # (tp, pp)


def stage_model(config, stage_layers: list[range], pp_rank: int) -> CodeGeeXModel:
    """The TP=1 CodeGeeXModel of pipeline stage ``pp_rank``, freshly initialised."""
    last = len(stage_layers) - 1
    return CodeGeeXModel(config, None, None, pre_process=pp_rank == 0, post_process=pp_rank == last,
                         layer_numbers=stage_layers[pp_rank])


def trained_weights(config) -> dict[str, torch.Tensor]:
    """A full state dict unlike any fresh model's, so a stage that failed to load would show."""
    g = torch.Generator().manual_seed(5)
    return {k: v + 0.1 * torch.randn(v.shape, generator=g)
            for k, v in CodeGeeXModel(config, None, None).state_dict().items()}


def assert_same(a: dict, b: dict) -> None:
    """Same names in the same order, bit-identical tensors."""
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def shard_shape(shape: torch.Size, name: str, tp: int, config) -> tuple[int, ...]:
    spec = partition_spec(name, config)
    if spec is None:
        return tuple(shape)
    return tuple(n // tp if d == spec[0] else n for d, n in enumerate(shape))


@pytest.fixture(scope="module")
def config():
    return tiny_config(num_layers=4)


@pytest.fixture(scope="module")
def full(config):
    return trained_weights(config)


# --- Splitting ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tp,pp", LAYOUTS)
def test_shards_have_the_stage_models_names_shapes_and_values(config, full, tp, pp):
    stage_layers = stage_layer_ranges(config.num_layers, pp)
    shards = split_model_parallel(full, config, tp, stage_layers)
    assert len(shards) == tp * pp
    for pp_rank in range(pp):
        expected = stage_model(config, stage_layers, pp_rank).state_dict()
        for tp_rank in range(tp):
            shard = shards[pp_rank * tp + tp_rank]  # checkpoint (MP) order
            assert list(shard) == list(expected), (pp_rank, tp_rank)
            for name, tensor in shard.items():
                assert tensor.shape == shard_shape(expected[name].shape, name, tp, config), name
            if tp == 1:
                assert_same(shard, {k: full[k] for k in expected})


def test_word_table_is_on_the_first_and_last_stage_only(config, full):
    stages = split_pipeline_stages(full, config, stage_layer_ranges(config.num_layers, 4))
    assert ["word_embeddings.weight" in s for s in stages] == [True, False, False, True]
    assert ["position_embeddings.weight" in s for s in stages] == [True, False, False, False]
    assert ["top_query_layer.attention.query.weight" in s for s in stages] == [False, False, False, True]
    assert [sorted({k.split(".")[1] for k in s if k.startswith("layers.")}) for s in stages] == [
        ["0"], ["1"], ["2"], ["3"]]


@pytest.mark.parametrize("stage_layers", [[range(0, 2), range(3, 4)], [range(2, 4), range(0, 2)], []])
def test_stage_ranges_that_do_not_tile_the_layers_are_an_error(config, full, stage_layers):
    with pytest.raises(ValueError, match="do not cover layers 0..3"):
        split_pipeline_stages(full, config, stage_layers)


def test_unknown_parameter_is_an_error(config, full):
    with pytest.raises(ValueError, match="'extra.weight' belongs to no pipeline stage"):
        split_pipeline_stages({**full, "extra.weight": torch.zeros(1)}, config, [range(0, 4)])


# --- Checkpoints ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("tp,pp", LAYOUTS)
def test_save_then_load_full_is_exact(config, full, tmp_path, tp, pp):
    shards = split_model_parallel(full, config, tp, stage_layer_ranges(config.num_layers, pp))
    save_model_checkpoint(tmp_path, shards, config, tp, pp_size=pp)
    assert sorted(p.name for p in (tmp_path / "iter_0000000").iterdir()) == [
        f"mp_rank_{r:02d}_model_states.pt" for r in range(tp * pp)]
    loaded, _, meta = load_full_state_dict(tmp_path)
    assert (meta["tp_size"], meta["pp_size"]) == (tp, pp)
    assert_same(loaded, full)


def test_reshard_tool_2x2_to_1x4_to_1x1_is_exact(config, full, convert, tmp_path):
    save_model_checkpoint(tmp_path / "2x2", split_model_parallel(full, config, 2, stage_layer_ranges(4, 2)),
                          config, 2, pp_size=2, iteration=7, tag="iter_0000007")
    convert.main(["--load", str(tmp_path / "2x2"), "--save", str(tmp_path / "1x4"),
                  "--pipeline-model-parallel-size", "4"])
    convert.main(["--load", str(tmp_path / "1x4"), "--save", str(tmp_path / "1x1")])
    for name, (tp, pp) in (("1x4", (1, 4)), ("1x1", (1, 1))):
        loaded, _, meta = load_full_state_dict(tmp_path / name)
        assert (meta["tp_size"], meta["pp_size"], meta["iteration"]) == (tp, pp, 7)
        assert_same(loaded, full)
    for pp_rank in range(4):  # each 1x4 file holds exactly its stage's parameters
        stage = stage_model(config, stage_layer_ranges(4, 4), pp_rank)
        load_model_checkpoint(tmp_path / "1x4", stage, pp_size=4, pp_rank=pp_rank)  # strict


def test_uneven_split(convert, tmp_path):
    config = tiny_config(num_layers=5)
    full = trained_weights(config)
    save_model_checkpoint(tmp_path / "src", [full], config, 1)
    convert.main(["--load", str(tmp_path / "src"), "--save", str(tmp_path / "pp2"),
                  "--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "2"])
    stage_layers = [range(0, 2), range(2, 5)]
    for pp_rank in range(2):
        load_model_checkpoint(tmp_path / "pp2", stage_model(config, stage_layers, pp_rank), pp_size=2,
                              pp_rank=pp_rank)  # strict: the files hold layers 0-1 and 2-4
    assert_same(load_full_state_dict(tmp_path / "pp2")[0], full)


@pytest.mark.parametrize("flags,message", [
    ([], "--num-layers 5 is not divisible by --pipeline-model-parallel-size 2.*--decoder-first-pipeline-num-layers"),
    (["--decoder-first-pipeline-num-layers", "5"], "leave 0 of --num-layers 5"),
])
def test_bad_split_is_one_clear_line(convert, tmp_path, flags, message):
    config = tiny_config(num_layers=5)
    save_model_checkpoint(tmp_path / "src", [CodeGeeXModel(config, None, None).state_dict()], config, 1)
    with pytest.raises(SystemExit) as exc:
        convert.main(["--load", str(tmp_path / "src"), "--save", str(tmp_path / "out"),
                      "--pipeline-model-parallel-size", "2", *flags])
    assert isinstance(exc.value.code, str) and "\n" not in exc.value.code
    assert exc.value.code.startswith("convert_checkpoint.py: error: ")
    assert re.search(message, exc.value.code), exc.value.code
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_layout_flags_with_to_hf_are_refused(convert, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        convert.main(["--load", str(tmp_path), "--to-hf", str(tmp_path / "hf"), "--pipeline-model-parallel-size", "2"])
    assert exc.value.code == 2 and "--pipeline-model-parallel-size: --to-hf writes one" in capsys.readouterr().err


# --- Hugging Face GPT-2 ---------------------------------------------------------------------------------

def test_hf_to_tp2_pp2_and_back_is_exact(convert, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(1)
    hf_model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=32, n_head=4, vocab_size=1000, n_positions=64))
    with torch.no_grad():  # HF inits biases to 0 and LayerNorms to 1/0: perturb all so each mapping matters
        for p in hf_model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf_model.save_pretrained(tmp_path / "hf")
    convert.main(["--from-hf", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt"),
                  "--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2"])
    assert len(list((tmp_path / "ckpt" / "iter_0000000").iterdir())) == 4
    convert.main(["--load", str(tmp_path / "ckpt"), "--to-hf", str(tmp_path / "back")])
    original = hf_model.state_dict()
    back = GPT2LMHeadModel.from_pretrained(tmp_path / "back").state_dict()
    assert set(back) == set(original)
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name


# --- Numerics -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stage_layers", [[range(0, 2), range(2, 4)], [range(0, 1), range(1, 4)]])
def test_chained_stages_loaded_from_a_pp2_checkpoint_give_the_whole_models_logits(tmp_path, stage_layers):
    config = tiny_config(num_layers=4)  # dropout 0
    whole = CodeGeeXModel(config, None, None).eval()
    whole.load_state_dict(trained_weights(config))
    save_model_checkpoint(tmp_path, split_model_parallel(whole.state_dict(), config, 1, stage_layers), config, 1,
                          pp_size=2)
    stages = [stage_model(config, stage_layers, r).eval() for r in range(2)]  # fresh weights until loaded
    for pp_rank, stage in enumerate(stages):
        load_model_checkpoint(tmp_path, stage, pp_size=2, pp_rank=pp_rank)
    ids, pos, _, _ = make_batch(config)
    with torch.no_grad():
        hidden = stages[0](ids, pos)  # (b, s, h)
        logits = stages[1](hidden, pos)  # (b, s, v) at TP 1
        expected = whole(ids, pos)
    assert hidden.shape == (*ids.shape, config.hidden_size) and logits.shape == expected.shape
    assert max_err(logits, expected) <= 1e-6
