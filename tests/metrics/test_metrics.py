"""Metrics logging: record helpers, console format, JSON lines, and wandb read back from its offline files.

No test touches the network: every wandb run is offline, HOME is a temporary directory (no .netrc) and
the server URL points at a closed local port in case anything tries to go online.
"""

import json
import logging
import sys
import time

import pytest
import torch

from codegeex_train.config.arguments import LoggingConfig
from codegeex_train.metrics import (
    MetricsLogger,
    format_record,
    memory_gb,
    plain_record,
    read_offline_wandb_history,
    throughput_record,
    wandb_sink,
)
from codegeex_train.metrics.wandb_sink import choose_wandb_mode, has_wandb_credentials, wandb_key

TRAIN = [
    {"iteration": 1, "consumed_samples": 32, "lr": 1.5e-4, "loss": 9.125, "grad_norm": 3.5, "loss_scale": 1.0,
     "iteration_time_ms": 812.25, "tokens_per_s": 12345.5, "tflops_per_device": 0.12, "memory_gb": 1.23},
    {"iteration": 2, "consumed_samples": 64, "lr": torch.tensor(3e-4), "loss": torch.tensor(8.5),
     "grad_norm": 2.75, "loss_scale": 1.0, "iteration_time_ms": 790.0, "tokens_per_s": 13000.0,
     "tflops_per_device": 0.125, "memory_gb": 1.25},
]
VALID = {"iteration": 2, "split": "valid", "valid_loss": 8.75, "valid_ppl": 6310.69}


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    """A clean wandb environment: no key, no netrc, no mode, and a dead server URL as a safety net."""
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_DIR", "WANDB_CONFIG_DIR",
                "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "NETRC", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("WANDB_SILENT", "true")
    return monkeypatch


def make_logger(tmp_path, *, enabled=True, project=None, resume_wandb_id=None, save="save", **cfg):
    cfg = LoggingConfig(wandb_project=project, wandb_dir=str(tmp_path / "wandb") if project else None,
                        progress_bar=False, **cfg)
    return MetricsLogger(cfg, enabled=enabled, save_dir=str(tmp_path / save) if save else None,
                         run_config={"hidden_size": 64, "lr": 3e-4}, train_iters=100,
                         resume_wandb_id=resume_wandb_id, wandb_init_timeout=5.0)


def offline_history(tmp_path, run_id):
    """Every offline segment of run ``run_id`` (a resumed run adds one), without wandb's own _ keys."""
    rows = []
    for run_dir in sorted((tmp_path / "wandb" / "wandb").glob(f"offline-run-*-{run_id}*")):
        rows += read_offline_wandb_history(run_dir)
    rows.sort(key=lambda row: row["_step"])
    return [({k: v for k, v in row.items() if not k.startswith("_")}, row["_step"]) for row in rows]


def expected_wandb_rows(records):
    rows = {}
    for record in map(plain_record, records):
        row = rows.setdefault(record["iteration"], {})
        row.update({wandb_key(k, record["split"]): v for k, v in record.items()
                    if k not in ("iteration", "split") and v is not None})
    return [(row, step) for step, row in sorted(rows.items())]


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_throughput_record():
    r = throughput_record(2.0, tokens_per_iteration=4096, flops_per_iteration=8e12, world_size=4,
                          peak_flops_per_device=1e12)
    assert r == pytest.approx({"iteration_time_ms": 2000.0, "tokens_per_s": 2048.0, "tflops_per_device": 1.0,
                               "mfu": 1.0})
    assert "mfu" not in throughput_record(2.0, 4096, 8e12, 4)


def _proc_status_gib(field: str) -> float:
    """A ``/proc/self/status`` size (``VmHWM``: peak RSS, ``VmRSS``: current), kB there, in GiB."""
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
    return kib / 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the kernel's peak RSS from /proc")
def test_memory_gb_on_cpu_is_peak_rss():
    import numpy as np

    cpu = torch.device("cpu")
    # The kernel's own high-water mark, read independently: a KiB/MiB/byte slip is a factor of 1024 off it.
    before = memory_gb(cpu)
    assert before == pytest.approx(_proc_status_gib("VmHWM"), rel=0.01)
    # Push the peak 256 MiB above the previous one (the current RSS may sit below an earlier peak), with every
    # page written so that it is resident: the reported peak must rise by that much, in GiB, and stay there once
    # the buffer is freed (a peak, not the current RSS).
    grow = _proc_status_gib("VmHWM") - _proc_status_gib("VmRSS") + 0.25
    buffer = np.ones(int(grow * 2**30), dtype=np.uint8)
    del buffer
    after = memory_gb(cpu)
    assert after - before == pytest.approx(0.25, abs=0.02)
    assert after == pytest.approx(_proc_status_gib("VmHWM"), rel=0.01)


def test_plain_record_converts_tensors_and_needs_iteration():
    r = plain_record({"loss": torch.tensor(2.5), "iteration": 3})
    assert r == {"iteration": 3, "split": "train", "loss": 2.5} and type(r["loss"]) is float
    with pytest.raises(ValueError, match="iteration"):
        plain_record({"loss": 1.0})


def test_console_line_format():
    record = {"iteration": 20, "consumed_samples": 640, "lr": 2.9e-4, "loss": 5.1234, "grad_norm": 1.234,
              "loss_scale": 1.0, "iteration_time_ms": 812.3, "tokens_per_s": 12345.4, "tflops_per_device": 0.12,
              "mfu": 0.012, "memory_gb": 1.23}
    assert format_record(record, 100) == (
        " iteration       20/     100 | samples: 640 | ms/iter: 812.3 | lr: 2.900E-04 | loss: 5.1234E+00 | "
        "loss scale: 1.0 | grad norm: 1.234 | tokens/s: 12345 | TFLOP/s/dev: 0.12 | MFU: 1.2% | mem GB: 1.23")
    assert format_record({"iteration": 3, "loss": 2.0, "grad_norm": None, "skipped": 1}, 10) == (
        " iteration        3/      10 | loss: 2.0000E+00 | skipped: 1")
    assert format_record({"iteration": 4, "loss": float("nan"), "tokens": 123456}, 10) == (
        " iteration        4/      10 | loss: nan | tokens: 123456")
    assert format_record(VALID, 100) == (
        " validation loss at iteration        2 | loss: 8.7500E+00 | ppl: 6.3107E+03")


# A train record as the trainer builds it on a CPU run (TP 2, PP 1): Megatron's fields, speed, memory, and the bytes
# each process group moved, measured and predicted (training/trainer.py: _train_record, comm_record).
FULL_TRAIN = {"iteration": 20, "consumed_samples": 640, "lr": 2.9e-4, "loss": 5.1234, "grad_norm": 1.234,
              "loss_scale": 1.0, "skipped_iterations": 0, "iteration_time_ms": 8123.4, "tokens_per_s": 12345.5,
              "tflops_per_device": 0.0123, "memory_gb": 1.23,
              **{f"comm_{group}_bytes{suffix}": 123_456_789 if group == "tp" else 0
                 for group in ("dp", "embedding", "mp", "pp", "tp") for suffix in ("", "_theory")}}
MEMORY = {"iteration": 2, "split": "memory", "memory_weights_bytes": 1_234_567, "memory_total_bytes": 9_876_543,
          "memory_weights_bytes_theory": 1_234_000, "memory_gb": 1.5}


def test_console_line_is_megatrons_fields_without_byte_counts(tmp_path, capsys):
    line = format_record(FULL_TRAIN, 100)
    assert "comm_" not in line and "bytes" not in line and len(line) < 200, (len(line), line)
    assert line == (" iteration       20/     100 | samples: 640 | ms/iter: 8123.4 | lr: 2.900E-04 | loss: 5.1234E+00 | "
                    "loss scale: 1.0 | grad norm: 1.234 | skipped: 0 | tokens/s: 12346 | TFLOP/s/dev: 0.01 | "
                    "mem GB: 1.23")
    # Every field Megatron's line has (global batch size and nan iterations when a record carries them), in its
    # order, then speed and memory.
    everything = {**FULL_TRAIN, "global_batch_size": 32, "nan_iterations": 0, "mfu": 0.012}
    line = format_record(everything, 100)
    labels = ["iteration", "samples:", "ms/iter:", "lr:", "global batch: 32", "loss:", "loss scale:", "grad norm:",
              "skipped:", "nan: 0", "tokens/s:", "TFLOP/s/dev:", "MFU:", "mem GB:"]
    assert [line.index(label) for label in labels] == sorted(line.index(label) for label in labels), line
    assert "comm_" not in line and len(line) < 240
    assert format_record(MEMORY, 100) == " memory at iteration        2 | mem GB: 1.50"
    # The file (and wandb, from the same plain record) still gets every field.
    logger = make_logger(tmp_path)
    logger.log(FULL_TRAIN)
    logger.log(MEMORY)
    logger.close()
    assert capsys.readouterr().out.splitlines() == [format_record(plain_record(FULL_TRAIN), 100),
                                                    format_record(MEMORY, 100)]
    assert read_jsonl(tmp_path / "save" / "metrics.jsonl") == [plain_record(FULL_TRAIN), plain_record(MEMORY)]


def test_console_sink_prints_one_line_per_record(tmp_path, capsys):
    logger = make_logger(tmp_path, save=None)
    logger.log(TRAIN[0])
    logger.log(VALID)
    logger.close()
    lines = capsys.readouterr().out.splitlines()
    assert lines == [format_record(plain_record(TRAIN[0]), 100), format_record(VALID, 100)]


def test_disabled_logger_writes_nothing(tmp_path, capsys, wandb_env):
    logger = make_logger(tmp_path, enabled=False, project="p")
    logger.advance(1)
    logger.log(TRAIN[0])
    logger.close()
    assert logger.wandb_run_id is None
    assert capsys.readouterr() == ("", "")
    assert list(tmp_path.iterdir()) == []


def test_metrics_file_appends_across_loggers(tmp_path):
    first = make_logger(tmp_path)
    first.log(TRAIN[0])
    first.close()
    second = make_logger(tmp_path)  # a resumed run: same save directory
    second.log(TRAIN[1])
    second.close()
    assert read_jsonl(tmp_path / "save" / "metrics.jsonl") == [plain_record(r) for r in TRAIN]


def test_explicit_metrics_file_without_save_dir(tmp_path):
    logger = make_logger(tmp_path, save=None, metrics_file=str(tmp_path / "m" / "metrics.jsonl"))
    logger.log(VALID)
    logger.close()
    assert read_jsonl(tmp_path / "m" / "metrics.jsonl") == [VALID]


@pytest.mark.slow
def test_wandb_offline_history_equals_records_and_jsonl(tmp_path, wandb_env):
    wandb_env.setenv("WANDB_MODE", "offline")
    with make_logger(tmp_path, project="codegeex-test", wandb_name="tiny") as logger:
        for record in TRAIN:
            logger.advance(record["iteration"])
            logger.log(record)
        logger.log(VALID)
        run_id = logger.wandb_run_id
        assert logger.wandb.mode == "offline"
    jsonl = read_jsonl(tmp_path / "save" / "metrics.jsonl")
    assert jsonl == [plain_record(r) for r in TRAIN + [VALID]]
    history = offline_history(tmp_path, run_id)
    assert history == expected_wandb_rows(TRAIN + [VALID]) == expected_wandb_rows(jsonl)
    assert history[0][0]["train/loss"] == 9.125 and history[1][0]["valid/ppl"] == 6310.69


@pytest.mark.slow
def test_no_key_falls_back_to_offline_without_hanging(tmp_path, wandb_env):
    assert choose_wandb_mode(dict(HOME=str(tmp_path / "home"))) == "offline"
    start = time.monotonic()
    logger = make_logger(tmp_path, project="p")
    assert logger.wandb.mode == "offline"
    logger.log(TRAIN[0])
    logger.close()
    assert time.monotonic() - start < 20
    assert [step for _, step in offline_history(tmp_path, logger.wandb_run_id)] == [1]


def test_credentials_from_env_or_netrc(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    assert not has_wandb_credentials({"HOME": str(home)})
    assert has_wandb_credentials({"HOME": str(home), "WANDB_API_KEY": "x" * 40})
    netrc = home / ".netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    netrc.chmod(0o600)
    assert has_wandb_credentials({"HOME": str(home)})
    assert not has_wandb_credentials({"HOME": str(home), "WANDB_BASE_URL": "https://wandb.example.com"})
    assert choose_wandb_mode({"HOME": str(home)}) is None
    assert choose_wandb_mode({"HOME": str(tmp_path), "WANDB_MODE": "online"}) is None


def test_init_failure_falls_back_to_offline(tmp_path, wandb_env, caplog):
    import wandb

    real_init, real_teardown, calls = wandb.init, wandb.teardown, []

    def failing_online_init(*args, mode=None, **kwargs):
        calls.append(f"init {mode}")
        if mode != "offline":
            raise wandb.errors.CommError("Timed out while retrying: dial tcp: connection refused")
        return real_init(*args, mode=mode, **kwargs)

    def teardown():
        calls.append("teardown")
        real_teardown()

    wandb_env.setenv("WANDB_API_KEY", "k" * 40)  # looks logged in, so the first try is online
    wandb_env.setattr(wandb, "init", failing_online_init)
    wandb_env.setattr(wandb, "teardown", teardown)
    with caplog.at_level(logging.WARNING, logger=wandb_sink.__name__):
        logger = make_logger(tmp_path, project="p")
    # A real failed init keeps the run id reserved in wandb's service ("run ID is in use") until teardown.
    assert calls == ["init None", "teardown", "init offline"] and logger.wandb.mode == "offline"
    assert [r.levelname for r in caplog.records] == ["WARNING"] and "CommError" in caplog.text
    logger.close()


def test_resume_continues_the_same_wandb_run(tmp_path, wandb_env):
    wandb_env.setenv("WANDB_MODE", "offline")
    first = make_logger(tmp_path, project="p")
    first.log(TRAIN[0])
    first.close()
    second = make_logger(tmp_path, project="p", resume_wandb_id=first.wandb_run_id)
    assert second.wandb_run_id == first.wandb_run_id
    second.log(TRAIN[1])
    second.close()
    # Offline, each segment gets its own directory (same id); `wandb sync` uploads both to one run.
    assert offline_history(tmp_path, first.wandb_run_id) == expected_wandb_rows(TRAIN)


def test_progress_bar_follows_iterations(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # the bar is drawn on a terminal only
    cfg = LoggingConfig(progress_bar=True)
    logger = MetricsLogger(cfg, enabled=True, save_dir=None, run_config={}, train_iters=100, start_iteration=1)
    for iteration in (2, 3):
        logger.advance(iteration)
    logger.close()
    assert "3/100" in capsys.readouterr().err
