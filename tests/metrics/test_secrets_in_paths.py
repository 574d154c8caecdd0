"""Credentials inside a path or URL given as a flag (``s3://KEY:SECRET@bucket/x``, ``https://user:token@host/...``,
``...?token=...&X-Amz-Signature=...``) never reach what a run records (metrics.jsonl, wandb, the checkpoints),
while the run itself uses the path as given. The environment-variable side: tests/metrics/test_secrets.py."""

import dataclasses
import json
import sys
import types
import uuid

import pytest

from codegeex_train.checkpoint.files import tokenizer_settings
from codegeex_train.config.arguments import DataConfig, LoggingConfig
from codegeex_train.metrics import REDACTED, MetricsLogger, redact_secrets


@pytest.mark.parametrize("recorded,expected", [
    ("s3://AKIAIOSFODNN7EXAMPLE:wJalrXUtnFEMI/K7MDENG+bPxRfiCY@bucket/code_text_document",
     "s3://<redacted>@bucket/code_text_document"),
    ("https://user:ghp_token123@host.example/tok.json", "https://<redacted>@host.example/tok.json"),
    ("https://token-only@host/x", "https://<redacted>@host/x"),
    ("/work/https:/user:pw@host/x", "/work/https:/<redacted>@host/x"),  # what os.path.abspath leaves of a URL
    ("https://b.s3.amazonaws.com/x?X-Amz-Algorithm=AWS4&X-Amz-Credential=AKIA%2F2024&X-Amz-Signature=abc123"
     "&X-Amz-Security-Token=tok", "https://b.s3.amazonaws.com/x?X-Amz-Algorithm=AWS4&X-Amz-Credential=<redacted>"
     "&X-Amz-Signature=<redacted>&X-Amz-Security-Token=<redacted>"),
    ("https://acct.blob.core.windows.net/c/x?sv=2022-11-02&sig=Zm9v%3D", "https://acct.blob.core.windows.net/c/x?"
     "sv=2022-11-02&sig=<redacted>"),
    ("data/x?token=abc&page=2#frag", "data/x?token=<redacted>&page=2#frag"),
    ("gs://b/x?access_token=ya29.abc;api_key=k", "gs://b/x?access_token=<redacted>;api_key=<redacted>"),
], ids=["s3-key-and-secret", "https-user-token", "token-only", "made-absolute", "aws-presigned", "azure-sas",
        "query-token", "semicolon-parameters"])
def test_url_credentials_are_redacted(recorded, expected):
    assert redact_secrets(recorded, ()) == expected
    assert redact_secrets({"data_path": [recorded], recorded: 1}, ()) == {"data_path": [expected], expected: 1}


@pytest.mark.parametrize("plain", ["/data/code_text_document", "s3://bucket/prefix/x", "git@github.com:org/repo",
                                   "me@example.com", "file:///tmp/a@b", "https://host/x?page=2&lang=py", "a=b",
                                   "1e-05", "gelu"])
def test_ordinary_values_are_left_alone(plain):
    assert redact_secrets(plain, ()) == plain


def test_environment_secrets_still_redacted_beside_urls():
    secret = "hf_" + "x" * 20
    assert redact_secrets(f"https://u:p@h/{secret}", (secret,)) == f"https://{REDACTED}@h/{REDACTED}"


def test_the_checkpoint_tokenizer_record_is_redacted(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    flags = DataConfig(tokenizer_type="HFTokenizer", tokenizer_model="https://user:tok@host/tokenizer.json?sig=s",
                       vocab_file="/data/vocab.json")
    settings = tokenizer_settings(flags)
    assert settings["tokenizer_model"] == f"{tmp_path}/https:/{REDACTED}@host/tokenizer.json?sig={REDACTED}"
    assert settings["vocab_file"] == "/data/vocab.json"
    assert flags.tokenizer_model == "https://user:tok@host/tokenizer.json?sig=s"  # the run's own copy is untouched


class FakeWandb:
    """wandb's entry points WandbSink calls, recording what it would have stored (no service, no files)."""

    def __init__(self):
        self.inits = []

    @staticmethod
    def Settings(**settings):
        return settings

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return types.SimpleNamespace(id=kwargs["id"], settings=types.SimpleNamespace(mode="offline"),
                                     log=lambda data, step: None, finish=lambda: None)

    def teardown(self):
        pass


def test_metrics_and_wandb_record_no_credential_from_a_path(tmp_path, monkeypatch, capsys):
    """The run config (wandb's config) as pretrain.py builds it from the sections, the command line (wandb's run
    metadata), a metadata line and a record: nothing of the credentials reaches wandb, metrics.jsonl or the
    console; the command line's metadata is turned off."""
    key, secret, token, signature = (f"{name}{uuid.uuid4().hex}" for name in ("AKIA", "secret", "tok", "sig"))
    data = f"s3://{key}:{secret}@bucket/code_text_document"
    tokenizer = f"https://user:{token}@host/tokenizer.json?X-Amz-Signature={signature}"
    wandb = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setattr(sys, "argv", ["pretrain.py", "--data-path", data, "--tokenizer-model", tokenizer])
    run_config = {"data": dataclasses.asdict(DataConfig(data_path=[data], tokenizer_model=tokenizer))}
    cfg = LoggingConfig(wandb_project="x", wandb_name=f"from {data}", progress_bar=False)
    with MetricsLogger(cfg, enabled=True, save_dir=str(tmp_path), run_config=run_config, train_iters=1) as logger:
        logger.log_metadata({"iteration": 0, "data": run_config["data"]})
        logger.log({"iteration": 1, "loss": 2.5, "note": f"read {tokenizer}"})
    [init] = wandb.inits
    assert init["settings"]["x_disable_meta"] is True  # wandb would store sys.argv
    assert init["config"]["data"]["data_path"] == [f"s3://{REDACTED}@bucket/code_text_document"]
    assert init["config"]["data"]["tokenizer_model"] == (f"https://{REDACTED}@host/tokenizer.json?"
                                                         f"X-Amz-Signature={REDACTED}")
    recorded = json.dumps(init, default=str) + (tmp_path / "metrics.jsonl").read_text() + "".join(capsys.readouterr())
    assert "note: read https://<redacted>@host" in recorded
    assert [m for m in (key, secret, token, signature) if m in recorded] == []
    assert run_config["data"]["data_path"] == [data]  # what the run uses is untouched
