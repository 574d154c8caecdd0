"""Credentials inside a path or URL given as a flag (``s3://KEY:SECRET@bucket/x``, ``https://user:token@host/...``,
``...?token=...&X-Amz-Signature=...``) never reach what a run records (metrics.jsonl, wandb, the checkpoints),
while the run itself uses the path as given. The environment-variable side: tests/metrics/test_secrets.py."""

import dataclasses
import json
import os
import sys
import types
import uuid

import pytest

from codegeex_train.checkpoint.files import tokenizer_settings
from codegeex_train.config.arguments import DataConfig, LoggingConfig, parse_args
from codegeex_train.metrics import REDACTED, MetricsLogger, redact_secrets
from tests.harness import fails_with, run_distributed, run_pretrain, scan, tiny_model_args, tiny_pretrain_args


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
    ("/runs/hf_AbCdEfGhIjKlMnOpQrStUvWxYz01234567/ckpt", "/runs/<redacted>/ckpt"),
    ("/runs/run_hf_AbCdEfGhIjKlMnOpQrStUvWxYz01234567-2", "/runs/run_<redacted>-2"),
    ("/clones/ghp_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789/repo", "/clones/<redacted>/repo"),
    ("/x/github_pat_11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVW", "/x/<redacted>"),
    ("/x/glpat-AbCdEf0123456789-_xyz/y", "/x/<redacted>/y"),
    ("/data/AKIAIOSFODNN7EXAMPLE/code", "/data/<redacted>/code"),
], ids=["s3-key-and-secret", "https-user-token", "token-only", "made-absolute", "aws-presigned", "azure-sas",
        "query-token", "semicolon-parameters", "hf-token-in-a-path", "hf-token-in-a-name", "github-token",
        "github-fine-grained", "gitlab-token", "aws-key-id"])
def test_url_credentials_are_redacted(recorded, expected):
    assert redact_secrets(recorded, ()) == expected
    assert redact_secrets({"data_path": [recorded], recorded: 1}, ()) == {"data_path": [expected], expected: 1}


@pytest.mark.parametrize("plain", ["/data/code_text_document", "s3://bucket/prefix/x", "git@github.com:org/repo",
                                   "me@example.com", "file:///tmp/a@b", "https://host/x?page=2&lang=py", "a=b",
                                   "1e-05", "gelu", "/ckpt/hf_checkpoints_converted_from_megatron_13b",
                                   "/cache/models--org--m/snapshots/0123456789abcdef0123456789abcdef01234567",
                                   "/runs/hf_exportedcheckpointfromrunnumber12345", "ghp_notes", "AKIA-docs"])
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


def test_a_run_writes_no_credential_from_its_paths(tmp_path, tiny_data):
    """A Hugging Face token in --save's directory name, an AWS key id in --data-path's, a URL's user information in
    --metrics-file's and a token in --tensorboard-dir's: no file the run writes holds any of them (config.yaml, both
    checkpoints searched inside their zip members, metrics, TensorBoard's and wandb's files), and its config.yaml,
    given those flags again, rebuilds the run."""
    secrets = {"hf": f"hf_Ab{uuid.uuid4().hex}", "aws_id": "AKIA" + uuid.uuid4().hex[:16].upper(),
               "password": f"pw{uuid.uuid4().hex}", "tensorboard": f"hf_Cd{uuid.uuid4().hex}"}
    run = tmp_path / "run"
    data_dir = tmp_path / f"data-{secrets['aws_id']}"
    data_dir.symlink_to(os.path.dirname(tiny_data))
    data = str(data_dir / os.path.basename(tiny_data))
    save = run / f"ckpt-{secrets['hf']}"
    secret_flags = ["--save", str(save), "--data-path", data,
                    "--metrics-file", str(run / "https:" / f"user:{secrets['password']}@host" / "metrics.jsonl"),
                    "--tensorboard-dir", str(run / f"tb-{secrets['tensorboard']}")]
    argv = tiny_pretrain_args(tiny_data, str(save), 2, "--save-interval", "1", "--wandb-project", "x",
                              "--wandb-dir", str(run / "wandb-files"), *secret_flags)
    run_distributed(run_pretrain, world_size=1, deadline_s=300, argv=argv)
    assert sorted(p.name for p in save.iterdir() if p.name.startswith("iter_")) == ["iter_0000001", "iter_0000002"]
    assert list(run.rglob("metrics.jsonl")) and list(run.glob("tb-*/events.out.tfevents.*"))
    assert list(run.glob("wandb-files/wandb/offline-run-*/*.wandb"))
    assert scan([run], secrets) == {}
    assert parse_args(["--config", str(save / "config.yaml"), *secret_flags]) == parse_args(argv)


def test_wandb_is_refused_a_directory_holding_a_credential(tmp_path, capsys):
    """wandb writes its directory into its own logs (debug.log, the .wandb file), which nothing redacts: a credential
    in --wandb-dir, or in --save when that is wandb's directory, is one line before anything starts."""
    token = f"hf_Ab{uuid.uuid4().hex}"
    argv = [*tiny_model_args(), "--data-path", "x", "--wandb-project", "p"]
    err = fails_with(capsys, [*argv, "--wandb-dir", str(tmp_path / token)], "--wandb-project: --wandb-dir",
                     "give --wandb-dir a directory without it")
    err += fails_with(capsys, [*argv, "--save", str(tmp_path / token)], "--save (the default --wandb-dir)")
    assert token not in err
    assert not list(tmp_path.iterdir())
