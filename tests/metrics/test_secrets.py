"""Credentials in the environment never reach the output, metrics.jsonl, the run config, wandb's files or the
checkpoints. Each credential gets a unique marker value; afterwards every byte the run wrote (zip members such
as the checkpoints' pickles searched decompressed as well) and everything it printed are searched for them."""

import os
import sys
import uuid
import zipfile
from pathlib import Path

import pytest

from codegeex_train.config.arguments import LoggingConfig
from codegeex_train.metrics import MetricsLogger, redact_secrets, secret_values
from tests.harness import free_port, leaks, run_process_group, scan

ROOT = Path(__file__).resolve().parents[2]
# Not a name containing NCCL: DeepSpeed's launcher (launch.py) prints every such variable with its value at its
# default log level (tried: a NCCL_TEST_SECRET marker showed up in the output).
CREDENTIALS = ("WANDB_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "AWS_SECRET_ACCESS_KEY", "GITHUB_TOKEN",
               "MLFLOW_TRACKING_PASSWORD")


def markers() -> dict[str, str]:
    return {name: f"{name.lower().replace('_', '-')}-{uuid.uuid4().hex}" for name in CREDENTIALS}


def test_scan_finds_a_planted_marker(tmp_path):
    secrets = markers()
    with zipfile.ZipFile(tmp_path / "a.pt", "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("archive/data.pkl", b"x" * 100 + secrets["HF_TOKEN"].encode())
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "log.txt").write_bytes(b"\x00\x01" + secrets["WANDB_API_KEY"].encode())
    assert scan([tmp_path], secrets) == {str(tmp_path / "a.pt"): {"HF_TOKEN"},
                                         str(tmp_path / "sub" / "log.txt"): {"WANDB_API_KEY"}}


@pytest.mark.slow
def test_a_real_run_leaks_no_credential(tmp_path, tiny_data):
    """The whole path a user takes: scripts/pretrain_codegen.sh with a hostfile (it writes .deepspeed_env into the
    output dir), the deepspeed launcher (--no_ssh, one node), TP 2, checkpoints every iteration, wandb offline."""
    secrets = markers()
    out_dir, wandb_home = tmp_path / "out", tmp_path / "wandb-home"
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("127.0.0.1 slots=2\n")
    venv_bin = str(Path(sys.executable).parent)  # the `deepspeed` console script lives beside python
    env = {**os.environ, **secrets, "PATH": venv_bin + os.pathsep + os.environ["PATH"], "PYTHON": sys.executable,
           "OUTPUT_DIR": str(out_dir), "DEVICE": "cpu", "TP": "2", "DATA_PATH": tiny_data, "SEQ_LENGTH": "32",
           "MICRO_BATCH": "2", "GLOBAL_BATCH": "4", "TRAIN_ITERS": "2", "HOSTFILE": str(hostfile),
           "LAUNCHER_ARGS": f"--no_ssh --node_rank 0 --master_addr 127.0.0.1 --master_port {free_port()}",
           "GLOO_SOCKET_IFNAME": "lo", "WANDB_MODE": "offline", "WANDB_CONFIG_DIR": str(wandb_home / "config"),
           "WANDB_CACHE_DIR": str(wandb_home / "cache"), "WANDB_DATA_DIR": str(wandb_home / "data")}
    cmd = ["bash", str(ROOT / "scripts" / "pretrain_codegen.sh"), "--num-layers", "2", "--hidden-size", "32",
           "--num-attention-heads", "4", "--max-position-embeddings", "64", "--log-interval", "1", "--eval-iters", "1",
           "--save-interval", "1", "--no-progress-bar", "--wandb-project", "x"]
    proc = run_process_group(cmd, env=env, cwd=ROOT, capture_output=True, timeout=600)  # a timeout kills the ranks too
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output.decode(errors="replace")[-4000:]
    assert b"iteration        2/       2" in proc.stdout
    assert (out_dir / "iter_0000002").is_dir() and (out_dir / "metrics.jsonl").is_file()
    assert list((out_dir / "wandb").glob("offline-run-*/*.wandb")) and (out_dir / ".deepspeed_env").is_file()
    assert list((out_dir / "logs").glob("train-*.log"))
    assert leaks(output, secrets) == set(), "printed"
    assert scan([out_dir, wandb_home], secrets) == {}


def test_credentials_in_config_name_or_argv_are_redacted(tmp_path, monkeypatch, capsys):
    """A credential's value pasted into a flag (so into the run config and the command line) or a record."""
    secret = f"hf-token-{uuid.uuid4().hex}"
    monkeypatch.setenv("HF_TOKEN", secret)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setattr(sys, "argv", [sys.argv[0], "--data-path", f"s3://bucket/{secret}/code_text_document"])
    cfg = LoggingConfig(wandb_project="x", wandb_name=f"run-{secret}", wandb_dir=str(tmp_path), progress_bar=False)
    run_config = {"data": {"data_path": [f"s3://bucket/{secret}/code_text_document"]}}
    with MetricsLogger(cfg, enabled=True, save_dir=str(tmp_path), run_config=run_config, train_iters=2) as logger:
        logger.log({"iteration": 1, "loss": 2.5, "note": f"from {secret}"})
        logger.log_metadata({"iteration": 1, "cluster": {"hosts": [secret]}})
    out, err = capsys.readouterr()
    assert "note: from <redacted>" in out
    assert secret not in out + err
    assert list(tmp_path.glob("wandb/offline-run-*/*.wandb"))
    assert scan([tmp_path], {"HF_TOKEN": secret}) == {}


def test_redact_secrets():
    env = {"WANDB_API_KEY": "k" * 40, "MY_DB_PASSWORD": "hunter2-long", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_DISABLE_TOKEN": "1", "PATH": "/usr/bin:/bin"}
    secrets = secret_values(env)
    assert secrets == ("k" * 40, "hunter2-long")  # short values and ordinary names are left alone
    value = {"a": ["x hunter2-long y", ("k" * 40,)], "hunter2-long": 3, "n": 1.5, "p": "/usr/bin"}
    assert redact_secrets(value, secrets) == {"a": ["x <redacted> y", ("<redacted>",)], "<redacted>": 3, "n": 1.5,
                                              "p": "/usr/bin"}


@pytest.mark.parametrize("name", ["WANDB_API_KEY", "HF_TOKEN", "AWS_SECRET_ACCESS_KEY", "MLFLOW_TRACKING_PASSWORD",
                                  "GITHUB_PAT", "GOOGLE_APPLICATION_CREDENTIALS", "HTTP_AUTHORIZATION"])
def test_credential_names(name):
    assert secret_values({name: "v" * 12}) == ("v" * 12,)
