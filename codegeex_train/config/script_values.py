"""The values of a config file that scripts/pretrain_codegen.sh needs, read as pretrain.py reads them.

    python -m codegeex_train.config.script_values FILE.yaml     # one KEY=VALUE line per key of SCRIPT_KEYS it sets

The script hands pretrain.py the whole file (``--config``) and adds a flag only for a variable the user set (which
wins) or for what the file leaves unset (its own defaults: data, DeepSpeed config, precision, output directory, ...).
So it must know what the file sets, and the values its layout arithmetic needs, exactly as pretrain.py will read them:
it asks this module, which reads the file with ``config_file.load`` (flow mappings, block lists, quotes and anchors
alike, and the same refusals), instead of parsing YAML itself. Keys are looked up in every section but ``planner:``
(field names are unique across sections; ``launch:`` holds the script's own two), dashes read as underscores. A value
is printed as the word the file holds (``words=True``: ``1e-4`` stays ``1e-4``), a switch as true/false, a list as
its items joined by spaces; null is unset (left out). A file pretrain.py would not read is one ``error:`` line, exit 2.
Only yaml and this package's config reader are imported (no torch): the script's start stays fast.
"""

from __future__ import annotations

import sys
from typing import Any

from codegeex_train.config.config_file import LAUNCH_KEYS, PLANNER_SECTION, ConfigFileError, load

# What the script reads, by field name (none of them has a second spelling; tests/scripts/test_config_values.py
# checks that against the flags).
SCRIPT_KEYS = (
    # its layout arithmetic and the summary
    "num_layers", "seq_length", "micro_batch_size", "global_batch_size", "num_microbatches", "train_iters",
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
    "num_layers_per_virtual_pipeline_stage", "sequence_parallel", "recompute_granularity", "checkpoint_activations",
    *LAUNCH_KEYS,
    # what its own defaults must not override
    "data_path", "train_data_path", "tokenizer_type", "tokenizer_model", "vocab_file", "merge_file",
    "deepspeed_config", "bf16", "fp16", "distributed_backend", "save", "load", "finetune",
    "fim_rate", "fim_split_sample",
    # the finish banner's continuation command (the decay a resume must keep)
    "lr_decay_iters",
)


def _word(path: str, key: str, value: Any) -> str:
    if isinstance(value, bool):
        word = "true" if value else "false"
    elif isinstance(value, list):
        word = " ".join(_word(path, key, v) for v in value)
    else:
        word = str(value)
    if "\n" in word or "\r" in word:
        raise ConfigFileError(f"--config {path}: {key} holds a line break, which scripts/pretrain_codegen.sh cannot "
                              f"pass on")
    return word


def script_values(path: str) -> dict[str, str]:
    """{key: the file's word} for each of ``SCRIPT_KEYS`` that ``path`` sets to a non-null value."""
    values: dict[str, str] = {}
    for section, settings in load(path, words=True).items():
        if str(section) == PLANNER_SECTION or not isinstance(settings, dict):
            continue  # a section that is no mapping: pretrain.py refuses it (its own line)
        for key, value in settings.items():
            name = str(key).replace("-", "_")
            if name in SCRIPT_KEYS and value is not None:
                values[name] = _word(path, f"{section}.{key}", value)
    return values


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m codegeex_train.config.script_values FILE.yaml", file=sys.stderr)
        return 2
    try:
        values = script_values(argv[0])
    except ConfigFileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write("".join(f"{key}={value}\n" for key, value in values.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
