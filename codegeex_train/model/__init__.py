"""The CodeGeeX model (GPT decoder + top query layer) with tensor parallelism, and its tools."""

from .checkpoint import (
    CheckpointError,
    load_full_state_dict,
    load_model_checkpoint,
    load_model_shard,
    read_latest,
    save_model_checkpoint,
)
from .codegeex import CodeGeeXModel
from .config import ModelConfig, ModelConfigError
from .flops import model_flops_per_iteration
from .sharding import (
    config_from_hf_gpt2,
    full_to_hf_gpt2,
    hf_gpt2_to_full,
    merge_state_dicts,
    partition_spec,
    split_state_dict,
)
from .summary import count_parameters, model_summary

__all__ = [
    "CodeGeeXModel",
    "ModelConfig",
    "ModelConfigError",
    "model_flops_per_iteration",
    "count_parameters",
    "model_summary",
    "split_state_dict",
    "merge_state_dicts",
    "partition_spec",
    "hf_gpt2_to_full",
    "full_to_hf_gpt2",
    "config_from_hf_gpt2",
    "save_model_checkpoint",
    "load_model_checkpoint",
    "load_model_shard",
    "load_full_state_dict",
    "read_latest",
    "CheckpointError",
]
