"""A metrics record is a flat dict: ``iteration``, an optional ``split`` and plain numbers. Building the speed and
memory fields, normalising values, and the one console line per record.

The console line is for a person: Megatron's fields (iteration, consumed samples, time per iteration, learning rate,
global batch size, loss, loss scale, grad norm, skipped and nan iterations) then speed (tokens/s, TFLOP/s per device,
MFU) and memory, about 200 characters. Byte counts (``comm_*_bytes``, ``comm_*_bytes_theory``,
``memory_*_bytes``: many per record) stay off it: the JSON-lines file, wandb and the plots get every field."""

from __future__ import annotations

import math
import sys

import torch


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


# (name, label, formatter) in console order, Megatron's first; eval names are shown without their split prefix.
_FIELDS = (
    ("consumed_samples", "samples", "{:.0f}".format),
    ("iteration_time_ms", "ms/iter", "{:.1f}".format),
    ("lr", "lr", "{:.3E}".format),
    ("global_batch_size", "global batch", "{:d}".format),
    ("loss", "loss", "{:.4E}".format),
    ("ppl", "ppl", "{:.4E}".format),
    ("loss_scale", "loss scale", "{:.1f}".format),
    ("grad_norm", "grad norm", "{:.3f}".format),
    ("skipped_iterations", "skipped", "{:d}".format),
    ("nan_iterations", "nan", "{:d}".format),
    ("tokens_per_s", "tokens/s", "{:.0f}".format),
    ("tflops_per_device", "TFLOP/s/dev", "{:.2f}".format),
    ("mfu", "MFU", _percent),
    ("memory_gb", "mem GB", "{:.2f}".format),
)
_FORMATTERS = {name: (label, fmt) for name, label, fmt in _FIELDS}
_ORDER = {name: i for i, (name, _, _) in enumerate(_FIELDS)}
_SPLIT_TITLES = {"valid": "validation", "test": "test"}


def console_field(name: str) -> bool:
    """Whether the console line shows ``name``: not the byte counts (``comm_<group>_bytes[_theory]``,
    ``memory_<part>_bytes[_theory]``), which only the file, wandb and the plots get."""
    return not (name.startswith("comm_") or name.endswith(("_bytes", "_bytes_theory")))


def _format_value(fmt, value) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # nan/inf: the format specs above would print "NAN"
    try:
        return fmt(value)
    except (ValueError, TypeError):  # e.g. a string where a number was expected
        return _generic(value)


def format_record(record: dict, train_iters: int) -> str:
    """One console line. Train: `` iteration      20/     100 | samples: ... | ms/iter: ... | lr: ...``; eval:
    `` validation loss at iteration      20 | loss: ... | ppl: ...``. Missing or None keys are skipped, and so are
    the byte counts (``console_field``)."""
    split = record.get("split", "train")
    if split == "train":
        head = f" iteration {record['iteration']:8d}/{train_iters:8d}"
    else:
        what = f"{_SPLIT_TITLES[split]} loss" if split in _SPLIT_TITLES else split
        head = f" {what} at iteration {record['iteration']:8d}"
    items = [(k if k in _FORMATTERS else k.removeprefix(split + "_"), v) for k, v in record.items()
             if k not in ("iteration", "split") and v is not None and console_field(k)]
    items.sort(key=lambda kv: _ORDER.get(kv[0], len(_ORDER)))  # stable: unknown keys keep their order
    parts = [head]
    for name, value in items:
        label, fmt = _FORMATTERS.get(name, (name, _generic))
        parts.append(f"{label}: {_format_value(fmt, value)}")
    return " | ".join(parts)
