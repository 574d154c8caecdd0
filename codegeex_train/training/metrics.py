"""Metrics are data: one record (a flat dict) per logged step, sent to interchangeable sinks.

A record holds ``iteration``, an optional ``split`` ("train" default, "valid", "test") and plain numbers.
Train records use the names ``consumed_samples lr loss grad_norm loss_scale skipped_iterations
iteration_time_ms tokens_per_s tflops_per_device mfu memory_gb`` (``skipped_iterations``: optimizer steps that
DeepSpeed skipped in the log interval, fp16 overflows); eval records ``{split}_loss {split}_ppl``. Any other key
is carried through every sink too. Sinks:

- console: one Megatron-style line per record (only the keys present);
- JSON lines (``--metrics-file``, default ``<save>/metrics.jsonl``): appended, so a resumed run continues
  the same file; after a restart from an older checkpoint some iterations appear twice, and the later
  line is the one that counts;
- wandb (``--wandb-project``): ``{split}/{name}`` at ``step=iteration``, offline when there is no key.

Only the logging rank (the last pipeline stage's first rank: it holds the loss) writes anything; every
other rank builds a ``MetricsLogger(enabled=False)`` so the trainer calls it unconditionally.

Credentials never reach a sink: the value of every environment variable whose name looks like a credential
(``*KEY*``, ``*TOKEN*``, ``*SECRET*``, ``*PASSWORD*``, ...; values of 8+ characters) is replaced by
``<redacted>`` wherever it appears in a record, the run config or the wandb run name (e.g. a token pasted
into a path on the command line), and wandb records no command line when one of them is in ``sys.argv``.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TextIO

import torch
from tqdm import tqdm

from .wandb_sink import WandbSink, read_offline_wandb_history

if TYPE_CHECKING:
    from ..arguments import LoggingConfig

__all__ = ["MetricsLogger", "ConsoleSink", "JsonlSink", "WandbSink", "format_record", "plain_record",
           "throughput_record", "memory_gb", "read_offline_wandb_history", "secret_values", "redact_secrets"]

# Environment variable names that hold credentials (WANDB_API_KEY, HF_TOKEN, AWS_SECRET_ACCESS_KEY,
# MLFLOW_TRACKING_PASSWORD, GITHUB_PAT, ...).
_CREDENTIAL_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL|AUTH|COOKIE|PRIVATE|_PAT$", re.IGNORECASE)
_MIN_SECRET_LENGTH = 8  # shorter values ("1", "true", "offline") would redact ordinary words
REDACTED = "<redacted>"


def secret_values(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The values of the credential-like variables in ``environ`` (default: this process's), longest first."""
    environ = os.environ if environ is None else environ
    found = {v for k, v in environ.items() if _CREDENTIAL_NAME.search(k) and len(v) >= _MIN_SECRET_LENGTH}
    return tuple(sorted(found, key=len, reverse=True))


def redact_secrets(value, secrets: tuple[str, ...] | None = None):
    """``value`` (a string, or dicts / lists / tuples of them, keys included) with every secret replaced by
    ``<redacted>``; other values unchanged."""
    secrets = secret_values() if secrets is None else secrets
    if not secrets:
        return value
    if isinstance(value, str):
        for secret in secrets:
            if secret in value:
                value = value.replace(secret, REDACTED)
        return value
    if isinstance(value, dict):
        return {redact_secrets(k, secrets): redact_secrets(v, secrets) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact_secrets(v, secrets) for v in value)
    return value


def throughput_record(iteration_time_s: float, tokens_per_iteration: int, flops_per_iteration: float,
                      world_size: int, peak_flops_per_device: float | None = None) -> dict:
    """Speed of one iteration. ``flops_per_iteration`` is the model's FLOPs for the global batch
    (``model_flops_per_iteration``), shared by all ``world_size`` devices; MFU needs the device's peak
    FLOP/s (e.g. 989e12 for an H100 in bf16) and is left out without it."""
    per_device = flops_per_iteration / iteration_time_s / world_size
    record = {
        "iteration_time_ms": 1000.0 * iteration_time_s,
        "tokens_per_s": tokens_per_iteration / iteration_time_s,
        "tflops_per_device": per_device / 1e12,
    }
    if peak_flops_per_device:
        record["mfu"] = per_device / peak_flops_per_device
    return record


def memory_gb(device: torch.device) -> float:
    """Peak memory of this process in GiB: CUDA's max allocated on a GPU, the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource  # POSIX only; imported here so the module still imports elsewhere

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**30 if sys.platform == "darwin" else peak / 2**20  # bytes on macOS, KiB on Linux


def _plain(value):
    """Tensors and numpy scalars -> Python numbers, so json and wandb see the same values."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "item"):
        return value.item()
    return float(value)


def plain_record(record: dict) -> dict:
    """``record`` with plain Python values, ``iteration`` and ``split`` first."""
    if "iteration" not in record:
        raise ValueError(f"a metrics record needs 'iteration'; got keys {sorted(record)}")
    return {"iteration": int(record["iteration"]), "split": record.get("split", "train"),
            **{k: _plain(v) for k, v in record.items() if k not in ("iteration", "split")}}


def _percent(x: float) -> str:
    return f"{100 * x:.1f}%"


def _generic(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


# (name, label, formatter) in console order; eval names are shown without their split prefix.
_FIELDS = (
    ("consumed_samples", "consumed samples", "{:.0f}".format),
    ("lr", "lr", "{:.3E}".format),
    ("loss", "loss", "{:.4E}".format),
    ("ppl", "ppl", "{:.4E}".format),
    ("grad_norm", "grad norm", "{:.3f}".format),
    ("loss_scale", "loss scale", "{:.1f}".format),
    ("skipped_iterations", "skipped iterations", "{:d}".format),
    ("iteration_time_ms", "iter time (ms)", "{:.1f}".format),
    ("tokens_per_s", "tokens/s", "{:.0f}".format),
    ("tflops_per_device", "TFLOP/s/device", "{:.2f}".format),
    ("mfu", "MFU", _percent),
    ("memory_gb", "mem (GB)", "{:.2f}".format),
)
_FORMATTERS = {name: (label, fmt) for name, label, fmt in _FIELDS}
_ORDER = {name: i for i, (name, _, _) in enumerate(_FIELDS)}
_SPLIT_TITLES = {"valid": "validation", "test": "test"}


def _format_value(fmt, value) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # nan/inf: the format specs above would print "NAN"
    try:
        return fmt(value)
    except (ValueError, TypeError):  # e.g. a string where a number was expected
        return _generic(value)


def format_record(record: dict, train_iters: int) -> str:
    """One console line. Train: `` iteration      20/     100 | lr: ... | loss: ...``; eval:
    `` validation loss at iteration      20 | loss: ... | ppl: ...``. Missing or None keys are skipped."""
    split = record.get("split", "train")
    if split == "train":
        head = f" iteration {record['iteration']:8d}/{train_iters:8d}"
    else:
        what = f"{_SPLIT_TITLES[split]} loss" if split in _SPLIT_TITLES else split
        head = f" {what} at iteration {record['iteration']:8d}"
    items = [(k.removeprefix(split + "_"), v) for k, v in record.items()
             if k not in ("iteration", "split") and v is not None]
    items.sort(key=lambda kv: _ORDER.get(kv[0], len(_ORDER)))  # stable: unknown keys keep their order
    parts = [head]
    for name, value in items:
        label, fmt = _FORMATTERS.get(name, (name, _generic))
        parts.append(f"{label}: {_format_value(fmt, value)}")
    return " | ".join(parts)


class Sink(Protocol):
    def write(self, record: dict) -> None: ...
    def close(self) -> None: ...


class ConsoleSink:
    """Prints each record as one line on stdout, through tqdm so an active progress bar is redrawn below."""

    def __init__(self, train_iters: int) -> None:
        self.train_iters = train_iters

    def write(self, record: dict) -> None:
        tqdm.write(format_record(record, self.train_iters), file=sys.stdout)
        sys.stdout.flush()

    def close(self) -> None:
        pass


class JsonlSink:
    """Appends one JSON object per record and flushes, so a crash loses at most the line being written."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO = self.path.open("a", encoding="utf-8")

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class MetricsLogger:
    """Fans each record out to the console, JSON-lines and wandb sinks, and drives the progress bar.

    Built on every rank; with ``enabled=False`` every method is a no-op and ``wandb_run_id`` is None (a
    trainer that saves the id from another rank must fetch it from the logging rank)."""

    def __init__(self, cfg: LoggingConfig, *, enabled: bool, save_dir: str | None, run_config: dict,
                 train_iters: int, start_iteration: int = 0, resume_wandb_id: str | None = None,
                 wandb_init_timeout: float = 30.0) -> None:
        self.enabled = enabled
        self.sinks: list[Sink] = []
        self.wandb: WandbSink | None = None
        self._bar: tqdm | None = None
        if not enabled:
            return
        self._secrets = secret_values()
        run_config = redact_secrets(run_config, self._secrets)
        self.sinks.append(ConsoleSink(train_iters))
        metrics_file = cfg.metrics_file or (os.path.join(save_dir, "metrics.jsonl") if save_dir else None)
        if metrics_file:
            self.sinks.append(JsonlSink(metrics_file))
        if cfg.wandb_project:
            self.wandb = WandbSink(project=cfg.wandb_project, name=redact_secrets(cfg.wandb_name, self._secrets),
                                   directory=cfg.wandb_dir or save_dir or os.getcwd(), run_config=run_config,
                                   run_id=resume_wandb_id, init_timeout=wandb_init_timeout)
            self.sinks.append(self.wandb)
        if cfg.progress_bar and sys.stderr.isatty():
            # Only on a terminal: redirected (e.g. `| tee logs/train-*.log`), each carriage-return redraw would
            # land in the log; the console lines above carry the same progress there.
            self._bar = tqdm(total=train_iters, initial=start_iteration, desc="train", unit="it",
                             dynamic_ncols=True, mininterval=1.0)

    @property
    def wandb_run_id(self) -> str | None:
        return self.wandb.run_id if self.wandb else None

    def log(self, record: dict) -> None:
        """Send one record (needs ``iteration``; values may be tensors or numpy scalars) to every sink."""
        if not self.enabled:
            return
        record = redact_secrets(plain_record(record), self._secrets)
        for sink in self.sinks:
            sink.write(record)
        if self._bar is not None and record["split"] == "train" and record.get("loss") is not None:
            self._bar.set_postfix(loss=f"{record['loss']:.4f}", refresh=False)

    def log_metadata(self, record: dict) -> None:
        """A ``split: metadata`` line in metrics.jsonl (run facts such as the cluster layout; wandb has them in
        its run config); not printed, not a metric."""
        if not self.enabled:
            return
        record = redact_secrets({"iteration": int(record["iteration"]), "split": "metadata",
                                 **{k: v for k, v in record.items() if k != "iteration"}}, self._secrets)
        for sink in self.sinks:
            if isinstance(sink, JsonlSink):
                sink.write(record)

    def advance(self, iteration: int) -> None:
        """Move the progress bar to ``iteration`` (call every iteration; cheap, no host sync)."""
        if self._bar is not None:
            self._bar.update(iteration - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        for sink in self.sinks:
            sink.close()
        self.sinks = []

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
