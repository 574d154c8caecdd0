"""config/script_values.py: the values of a config file that scripts/pretrain_codegen.sh reads, as pretrain.py
reads them (tests/scripts/test_config_over_defaults.py runs the script on them)."""

from __future__ import annotations

import pytest

from codegeex_train.config.arguments import SECTIONS
from codegeex_train.config.config_file import LAUNCH_KEYS, known_keys
from codegeex_train.config.script_values import SCRIPT_KEYS, main, script_values


def test_each_key_the_script_reads_is_a_flag_with_one_spelling():
    """The reader matches field names (dashes as underscores): a key with another spelling (as `learning_rate` is
    `lr`'s) would be missed, and the script's default would override it."""
    spellings: dict[str, set[str]] = {}
    for keys in known_keys(SECTIONS).values():
        for key, field in keys.items():
            spellings.setdefault(field.name, set()).add(key)
    for key in SCRIPT_KEYS:
        assert key in LAUNCH_KEYS or spellings.get(key) == {key}, (key, spellings.get(key))


def test_values_are_the_words_pretrain_reads(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: {num_layers: 39}\n"
                    "parallel:\n  tensor-model-parallel-size: 8   # a flag's dashes\n  sequence_parallel: true\n"
                    "train: {seq_length: '2048', lr: 1e-4, save: null, global_batch_size: 3072}\n"
                    "data:\n  data_path: [0.5, a/x, 0.5, 'b/y']\n"
                    "launch: {recompute: selective}\n"
                    "planner: {world_size: 8}\n")
    assert script_values(str(path)) == {
        "num_layers": "39", "tensor_model_parallel_size": "8", "sequence_parallel": "true", "seq_length": "2048",
        "global_batch_size": "3072", "data_path": "0.5 a/x 0.5 b/y", "recompute": "selective"}


@pytest.mark.parametrize("text, named", [
    ("train: {seq_length: 0100}\n", "train.seq_length: 0100"),
    ("train: [1, 2\n", "c.yaml"),
    ("data: {data_path: \"a\\nb\"}\n", "data.data_path holds a line break"),
])
def test_a_file_pretrain_would_refuse_is_one_error_line(tmp_path, capsys, text, named):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    assert main([str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and err.startswith("error: --config ") and named in err, err
