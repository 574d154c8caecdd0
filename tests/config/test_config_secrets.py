"""Credentials in flags never reach the resolved config (``<save>/config.yaml``, every checkpoint's
``resolved_config``, the dry run's print-out), and a file holding a redacted value is not silently another run:
``--config`` refuses it unless the command line gives that flag. The run that writes it: tests/metrics/
test_secrets_in_paths.py."""

import uuid

import pytest

from codegeex_train.config.arguments import parse_args
from codegeex_train.config.config_file import dump_resolved


def credentials() -> dict[str, str]:
    """A unique value of each form the redaction knows, beside one only the environment names."""
    return {"hf": f"hf_Ab{uuid.uuid4().hex}", "aws_id": "AKIA" + uuid.uuid4().hex[:16].upper(),
            "aws_secret": f"wJalr/{uuid.uuid4().hex}+K7", "query": f"sig{uuid.uuid4().hex}",
            "env": f"env-token-{uuid.uuid4().hex}"}


def secret_argv(tmp_path, c: dict[str, str]) -> list[str]:
    return ["--save", str(tmp_path / f"runs-{c['hf']}" / "r1"),
            "--data-path", f"s3://{c['aws_id']}:{c['aws_secret']}@bucket/code_text_document",
            "--metrics-file", f"/logs/m.jsonl?X-Amz-Signature={c['query']}",
            "--tensorboard-dir", str(tmp_path / f"tb-{c['env']}"), "--wandb-name", "tiny"]


def test_the_resolved_config_holds_no_credential(tmp_path, monkeypatch):
    c = credentials()
    monkeypatch.setenv("MY_SERVICE_TOKEN", c["env"])
    text = dump_resolved(parse_args(secret_argv(tmp_path, c)))
    assert [name for name, value in c.items() if value in text] == []
    assert f"save: {tmp_path}/runs-<redacted>/r1" in text
    assert "- s3://<redacted>@bucket/code_text_document" in text
    assert "# Values holding <redacted> held a credential" in text
    assert "<redacted>" not in dump_resolved(parse_args(["--data-path", "x", "--save", str(tmp_path)]))


def refusal(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_a_redacted_value_is_refused_unless_the_command_line_gives_it(tmp_path, monkeypatch, capsys):
    """Read back, ``runs-<redacted>/r1`` would be a new directory and ``s3://<redacted>@bucket`` a failed read: the
    file is refused in one line naming the first such flag the command line does not give; with all of them given,
    the same run."""
    c = credentials()
    monkeypatch.setenv("MY_SERVICE_TOKEN", c["env"])
    argv = secret_argv(tmp_path, c)
    resolved = tmp_path / "config.yaml"
    resolved.write_text(dump_resolved(parse_args(argv)))
    assert refusal(capsys, ["--config", str(resolved)]) == (
        f"error: --config {resolved}: --save {tmp_path}/runs-<redacted>/r1: a credential was redacted from this "
        f"value when the file was written; give --save on the command line (it overrides the file)")
    assert "give --metrics-file on the command line" in refusal(capsys, ["--config", str(resolved), *argv[:4]])
    assert "give --tensorboard-dir on the command line" in refusal(
        capsys, ["--config", str(resolved), *argv[:6]])
    assert parse_args(["--config", str(resolved), *argv[:8]]) == parse_args(argv)
    as_assignments = [f"{flag}={value}" for flag, value in zip(argv[:8:2], argv[1:8:2])]
    assert parse_args(["--config", str(resolved), *as_assignments]) == parse_args(argv)
