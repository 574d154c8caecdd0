"""The DeepSpeed config, with the command line as its one source of truth.

Batch sizes, clipping, precision and ZeRO stage come from the flags. A user's ``--deepspeed-config``
JSON may add anything else (ZeRO bucket sizes, offload, loss-scale window, ...); a value that contradicts
a flag is an error naming both, never silently overridden either way.
"""

from __future__ import annotations

import json
from typing import Any

from codegeex_train.config.arguments import Args, ConfigError
from codegeex_train.layout.plan import ParallelPlan
from codegeex_train.bounded_read import FileReadError, read_text

_MISSING = object()
MAX_USER_CONFIG_BYTES = 1 << 20  # a DeepSpeed config is a few KiB


def _flag_values(args: Args, plan: ParallelPlan) -> dict[tuple[str, ...], tuple[Any, str]]:
    """DeepSpeed key path -> (value from the flags, the flag that set it)."""
    values = {
        # DeepSpeed's data-parallel world is our mpu's DP x CP group (each CP rank holds a share of every micro-batch
        # and reduces gradients with the others), and it checks train = micro x accumulation x that world.
        ("train_batch_size",): (plan.deepspeed_train_batch_size, "--global-batch-size"),
        ("train_micro_batch_size_per_gpu",): (plan.micro_batch_size, "--micro-batch-size"),
        ("gradient_accumulation_steps",): (plan.num_microbatches, "--num-microbatches"),
        # Set explicitly: DeepSpeed's default changed across versions, and CodeGeeX's own script never clipped.
        ("gradient_clipping",): (args.optim.clip_grad, "--clip-grad"),
        ("zero_optimization", "stage"): (args.train.zero_stage, "--zero-stage"),
        ("fp16", "enabled"): (plan.dtype == "fp16", "--fp16"),
        ("bf16", "enabled"): (plan.dtype == "bf16", "--bf16"),
    }
    return values


def _get(config: dict, path: tuple[str, ...]) -> Any:
    node: Any = config
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return _MISSING
        node = node[key]
    return node


def _set(config: dict, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        config = config.setdefault(key, {})
    config[path[-1]] = value


def load_user_config(path: str | None) -> dict:
    """The JSON object of --deepspeed-config (a regular file of at most ``MAX_USER_CONFIG_BYTES``), or {}."""
    if path is None:
        return {}
    try:
        config = json.loads(read_text(path, MAX_USER_CONFIG_BYTES, "--deepspeed-config"))
    except FileReadError as e:
        raise ConfigError(str(e)) from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"--deepspeed-config {path}: not valid JSON ({e})") from None
    except RecursionError:
        raise ConfigError(f"--deepspeed-config {path}: JSON nested too deeply") from None
    if not isinstance(config, dict):
        raise ConfigError(f"--deepspeed-config {path}: a JSON {type(config).__name__}, not an object of DeepSpeed "
                          f"settings")
    return config


def build_deepspeed_config(args: Args, plan: ParallelPlan, user: dict | None = None) -> dict:
    """The config handed to ``deepspeed.initialize`` (the batch arithmetic and precision from the plan, clipping and
    ZeRO stage from ``args``' optim and train sections); raises ConfigError on any contradiction."""
    config = json.loads(json.dumps(user or {}))  # deep copy
    for reserved in ("optimizer", "scheduler"):
        if reserved in config:
            raise ConfigError(f"--deepspeed-config has an {reserved!r} section: the optimizer and LR schedule come "
                              f"from the flags (--optimizer, --lr, --lr-decay-style, ...); remove the section")
    for path, (value, flag) in _flag_values(args, plan).items():
        existing = _get(config, path)
        if existing not in (_MISSING, "auto") and existing != value:
            raise ConfigError(f"--deepspeed-config sets {'.'.join(path)} = {existing!r} but {flag} gives {value!r}: "
                              f"remove it from the JSON or change the flag")
        if existing is _MISSING or existing == "auto":
            _set(config, path, value)
    if plan.dtype == "fp16":
        # Dynamic loss scaling unless the user's JSON pins a static scale.
        config["fp16"].setdefault("loss_scale", 0)
        config["fp16"].setdefault("initial_scale_power", 16)
    zero = config["zero_optimization"]
    if zero["stage"] > 0:
        zero.setdefault("contiguous_gradients", True)
        zero.setdefault("overlap_comm", False)  # overlap needs CUDA streams; DeepSpeed ignores it on CPU
    # We hand DeepSpeed a torch AdamW instance: no JIT-built fused/cpu Adam.
    config.setdefault("zero_allow_untested_optimizer", True)
    config.setdefault("steps_per_print", 10 ** 9)  # our logger prints; keep DeepSpeed's own quiet
    config.setdefault("wall_clock_breakdown", False)
    return config
