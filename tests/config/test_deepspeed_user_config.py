"""--deepspeed-config: a regular file of at most a bound, holding a JSON object; anything else is one ConfigError
naming the flag and the file (pretrain prints it as its one error line, before any process group)."""

from __future__ import annotations

import json

import pytest

from codegeex_train.config import deepspeed
from codegeex_train.config.arguments import ConfigError
from codegeex_train.config.deepspeed import load_user_config


def test_a_json_object_loads(tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"reduce_bucket_size": 1000}}))
    assert load_user_config(str(tmp_path / "ds.json")) == {"zero_optimization": {"reduce_bucket_size": 1000}}
    assert load_user_config(None) == {}


def test_what_is_not_a_small_json_object_file_is_one_config_error(tmp_path, monkeypatch):
    monkeypatch.setattr(deepspeed, "MAX_USER_CONFIG_BYTES", 1024)
    (tmp_path / "big.json").write_text(json.dumps({"comment": "x" * 2000}))
    (tmp_path / "list.json").write_text("[1, 2]")
    cases = {"/dev/null": "--deepspeed-config /dev/null: a character device, not a regular file",
             str(tmp_path): f"--deepspeed-config {tmp_path}: a directory, not a regular file",
             str(tmp_path / "big.json"): "big.json: larger than 1 KiB, the bound on this file",
             str(tmp_path / "list.json"): "list.json: a JSON list, not an object of DeepSpeed settings",
             str(tmp_path / "nope.json"): "nope.json: no such file"}
    for path, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            load_user_config(path)
