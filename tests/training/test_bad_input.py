"""Bad input fails with one clear ``error:`` line before any process group or training starts."""

import json

import numpy as np
import pytest

from codegeex_train.checkpoint.files import save_model_checkpoint
from codegeex_train.checkpoint.sharding import split_state_dict
from codegeex_train.config.model_config import ModelConfig
from tests.harness import fails_with, tiny_model_args, write_indexed_dataset

MODEL = tiny_model_args()


@pytest.fixture(autouse=True)
def in_an_empty_directory(tmp_path, monkeypatch):
    """Each refusal runs in an empty working directory (not the checkout) and must leave it empty."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    yield
    assert list(cwd.iterdir()) == []



def test_missing_data_path(capsys, tmp_path):
    fails_with(capsys, MODEL + ["--data-path", str(tmp_path / "nope")], "--data-path", "nope.idx",
               "tools/preprocess_data.py")
    fails_with(capsys, MODEL, "--data-path")


def test_empty_corpus(capsys, tmp_path):
    write_indexed_dataset(tmp_path / "empty", [], np.uint16)
    fails_with(capsys, MODEL + ["--data-path", str(tmp_path / "empty")], "no documents")


def test_token_ids_beyond_the_vocabulary(capsys, tmp_path):
    write_indexed_dataset(tmp_path / "big", [[1, 2, 3], [9000, 4]], np.int32)  # the shipped tokenizer has 8192 ids
    fails_with(capsys, MODEL + ["--data-path", str(tmp_path / "big")], "token id 9000", "8192", "--tokenizer")


def test_batch_arithmetic(capsys, tiny_data, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    base = MODEL + ["--data-path", tiny_data, "--tensor-model-parallel-size", "2"]  # DP = 2
    fails_with(capsys, base + ["--micro-batch-size", "3", "--global-batch-size", "8"],
               "--global-batch-size 8", "--micro-batch-size 3", "data-parallel size 2")
    fails_with(capsys, base + ["--micro-batch-size", "2", "--global-batch-size", "8", "--num-microbatches", "3"],
               "--num-microbatches 3", "= 2")
    fails_with(capsys, base + ["--num-attention-heads", "3", "--hidden-size", "33"], "--num-attention-heads 3")
    fails_with(capsys, base + ["--seq-length", "128"], "--max-position-embeddings 64")
    monkeypatch.setenv("WORLD_SIZE", "6")
    fails_with(capsys, base + ["--pipeline-model-parallel-size", "2"], "world size 6", "--tensor-model-parallel-size 2")


def test_deepspeed_json_contradicting_flags(capsys, tiny_data, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 2}}))
    fails_with(capsys, MODEL + ["--data-path", tiny_data, "--deepspeed-config", str(path), "--micro-batch-size", "4"],
               "train_micro_batch_size_per_gpu = 8", "--micro-batch-size gives 4")
    path.write_text(json.dumps({"gradient_clipping": 0.0}))
    fails_with(capsys, MODEL + ["--data-path", tiny_data, "--deepspeed-config", str(path)], "gradient_clipping",
               "--clip-grad")
    path.write_text(json.dumps({"bf16": {"enabled": True}}))
    fails_with(capsys, MODEL + ["--data-path", tiny_data, "--deepspeed-config", str(path)], "bf16.enabled", "--bf16")


def test_load_of_another_shape_names_both(capsys, tiny_data, tmp_path):
    config = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, max_position_embeddings=64,
                         vocab_size=8192)
    from codegeex_train.model.codegeex import CodeGeeXModel
    full = CodeGeeXModel(config, None, None).state_dict()
    save_model_checkpoint(tmp_path / "ck", split_state_dict(full, config, 2), config, 2)
    fails_with(capsys, MODEL + ["--data-path", tiny_data, "--load", str(tmp_path / "ck")],
               "hidden_size: checkpoint 64, this run 32")
    # The same shape at another TP size: model weights only, so the hint is the re-sharding tool.
    config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, max_position_embeddings=64,
                         vocab_size=8192)
    full = CodeGeeXModel(config, None, None).state_dict()
    save_model_checkpoint(tmp_path / "ck32", split_state_dict(full, config, 2), config, 2)
    fails_with(capsys, MODEL + ["--data-path", tiny_data, "--load", str(tmp_path / "ck32")],
               "saved at another parallel layout: TP 2 (this run 1)", "re-shards")


def test_load_pointing_at_nothing(capsys, tiny_data, tmp_path):
    fails_with(capsys, MODEL + ["--data-path", tiny_data, "--load", str(tmp_path / "missing")], "--load", "missing")
    (tmp_path / "empty").mkdir()
    fails_with(capsys, MODEL + ["--data-path", tiny_data, "--load", str(tmp_path / "empty")], "latest")


def test_pipeline_split(capsys, tiny_data, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    base = MODEL[2:] + ["--data-path", tiny_data, "--pipeline-model-parallel-size", "2"]
    fails_with(capsys, base + ["--num-layers", "3"], "--num-layers 3 is not divisible by --pipeline-model-parallel-size 2",
               "--decoder-first-pipeline-num-layers")
    fails_with(capsys, base + ["--num-layers", "3", "--decoder-first-pipeline-num-layers", "2",
                               "--decoder-last-pipeline-num-layers", "2"], "add up to 4", "--num-layers 3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    fails_with(capsys, MODEL[2:] + ["--data-path", tiny_data, "--pipeline-model-parallel-size", "4", "--num-layers", "2"],
               "--pipeline-model-parallel-size 4 is larger than --num-layers 2")
    fails_with(capsys, MODEL + ["--data-path", tiny_data, "--pipeline-model-parallel-size", "2", "--zero-stage", "0"],
               "--zero-stage 1 or 2")
